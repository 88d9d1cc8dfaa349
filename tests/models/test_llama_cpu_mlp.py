"""The Llama MLP's CPU path (atom/models/llama.py): SiLU in place on the gate half, and a
long input in blocks of rows, against the plain torch MLP."""

import pytest
import torch
import transformers
from torch.nn import functional as F

from atom.distributed import TensorParallelGroup
from atom.kernels import silu_and_mul_reference
from atom.models import llama


def _random_mlp() -> llama.LlamaMLP:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96)
    torch.manual_seed(0)
    mlp = llama.LlamaMLP(config, TensorParallelGroup.single())
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(0.0, 0.2)
    return mlp


def test_silu_and_mul_in_place_matches_reference():
    gate_up = torch.randn(7, 2 * 96)
    expected = silu_and_mul_reference(gate_up)
    got = llama.silu_and_mul_in_place(gate_up.clone())
    assert got.is_contiguous()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("rows", [1, 4, 5, 11])
def test_cpu_mlp_in_row_blocks_matches_torch(monkeypatch, rows):
    """Blocks of at most 4 rows: 1 and 4 rows run whole, 5 in 3 + 2, 11 in 4 + 4 + 3."""
    monkeypatch.setattr(llama, "CPU_MLP_BLOCK_ROWS", 4)
    mlp = _random_mlp()
    x = torch.randn(rows, 64)
    before = x.clone()
    gate, up = F.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
    expected = F.linear(F.silu(gate) * up, mlp.down_proj.weight)
    with torch.no_grad():
        got = mlp(x)
    assert torch.equal(x, before)  # the input is not written
    assert got.shape == (rows, 64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

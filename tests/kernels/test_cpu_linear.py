"""CPU linear layers on oneDNN-packed weights (atom/kernels/cpu_linear.py): the product
against F.linear, which form each row count takes (1 row: the transposed weight), the
layers' packing (a tied LM head's embedding table stays dense) and the Config.cpu_linear /
ATOM_CPU_LINEAR switch.

Tolerance: oneDNN sums in another order than MKL; on unit-scale inputs and weights of
scale in_features**-0.5 the outputs are O(1) and differ by at most ~1e-5 (1e-4 allowed).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from atom import envs
from atom.config import Config
from atom.kernels.cpu_linear import PackedLinearWeight, can_pack
from atom.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    linear,
    pack_cpu_weights,
)

ATOL = 1e-4

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


def _weight(out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=generator) * in_features**-0.5


@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (2, 64), (16, 64), (64, 64), (2, 3, 64)])
def test_packed_product_matches_f_linear(shape):
    weight, bias = _weight(96, 64), torch.randn(96)
    packed = PackedLinearWeight(weight)
    x = torch.randn(*shape)
    for b in (None, bias):
        got, want = packed(x, b), F.linear(x, weight, b)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_one_row_takes_the_transposed_weight_when_wide_and_more_rows_the_packed_one():
    weight, bias = _weight(96, 64), torch.randn(96)
    packed = PackedLinearWeight(weight)
    assert not packed.uses_packed(1) and packed.uses_packed(2) and packed.uses_packed(64)
    transposed = weight.t().contiguous()
    assert packed.transposed.shape == (64, 96) and torch.equal(packed.transposed, transposed)
    for shape in [(1, 64), (64,), (1, 1, 64)]:  # one row, however it is shaped
        x = torch.randn(*shape)
        # exactly MKL's product on the [in, out] layout, and F.linear up to summation order
        assert torch.equal(packed(x).reshape(1, 96), torch.mm(x.reshape(1, 64), transposed))
        assert torch.equal(
            packed(x, bias).reshape(1, 96), torch.addmm(bias, x.reshape(1, 64), transposed)
        )
        torch.testing.assert_close(packed(x, bias), F.linear(x, weight, bias), atol=ATOL, rtol=0)
    # a square or tall weight keeps no transposed copy: 1 row is F.linear itself
    for out_features, in_features in [(64, 64), (48, 64)]:
        tall = PackedLinearWeight(_weight(out_features, in_features))
        x = torch.randn(1, in_features)
        assert tall.transposed is None and torch.equal(tall(x), F.linear(x, tall.dense))


def test_a_weight_written_in_place_is_packed_again():
    weight = nn.Parameter(_weight(96, 64), requires_grad=False)
    packed = PackedLinearWeight(weight)
    x = torch.randn(4, 64)
    with torch.no_grad():
        weight[5] = 3.0
    torch.testing.assert_close(packed(x), F.linear(x, weight), atol=ATOL, rtol=0)
    with torch.no_grad():
        weight[7] = -2.0
    # the transposed copy too (the first call after a write lays both out again)
    torch.testing.assert_close(packed(x[:1]), F.linear(x[:1], weight), atol=ATOL, rtol=0)
    torch.testing.assert_close(packed(x), F.linear(x, weight), atol=ATOL, rtol=0)


def test_only_2d_fp32_cpu_weights_are_packed():
    assert can_pack(torch.empty(4, 4))
    assert not can_pack(torch.empty(4, 4, dtype=torch.bfloat16))
    assert not can_pack(torch.empty(4))
    with pytest.raises(ValueError, match="ATOM_CPU_LINEAR=dense"):
        PackedLinearWeight(torch.empty(4, 4, dtype=torch.bfloat16))


class _TinyTiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = VocabParallelEmbedding(50, 32)
        self.up = ColumnParallelLinear(32, [48, 16], bias=True)
        self.down = RowParallelLinear(64, 32, bias=True)
        self.head = ParallelLMHead(50, 32)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids):
        hidden = self.down(self.up(self.embed(ids)))
        return self.head.compute_logits(hidden)


def test_layers_pack_once_and_a_tied_embedding_stays_dense():
    torch.manual_seed(0)
    model = _TinyTiedModel()
    for parameter in model.parameters():
        nn.init.normal_(parameter, std=0.2)
    ids = torch.tensor([3, 7, 11, 49])
    with torch.no_grad():
        dense_logits = model(ids)
        dense_rows = model.embed(ids)
        assert pack_cpu_weights(model) == 3  # up, down, the shared table once
        assert pack_cpu_weights(model) == 0
        assert model.head.weight.cpu_packed is model.embed.weight.cpu_packed
        assert torch.equal(model.embed(ids), dense_rows)  # the lookup reads the dense table
        torch.testing.assert_close(model(ids), dense_logits, atol=ATOL, rtol=0)
        x = torch.randn(5, 32)
        torch.testing.assert_close(
            linear(x, model.up.weight, model.up.bias),
            F.linear(x, model.up.weight, model.up.bias),
            atol=ATOL,
            rtol=0,
        )


def test_the_switch(monkeypatch):
    monkeypatch.delenv("ATOM_CPU_LINEAR", raising=False)
    assert envs.cpu_linear() == "packed" and Config(device="cpu").cpu_linear == "packed"
    monkeypatch.setenv("ATOM_CPU_LINEAR", "Dense")
    assert Config(device="cpu").cpu_linear == "dense"
    assert Config(device="cpu", cpu_linear="packed").cpu_linear == "packed"  # the field wins
    monkeypatch.setenv("ATOM_CPU_LINEAR", "mkl")
    with pytest.raises(ValueError, match="ATOM_CPU_LINEAR"):
        Config(device="cpu")
    with pytest.raises(ValueError, match="cpu_linear"):
        Config(device="cpu", cpu_linear="fast")

"""A Llama decoder layer with its GEMV fusions (atom/fusions.py: norm_gemv, gemv_silu) gives
the unfused layer's outputs: the fused paths run under the Triton interpreter here."""

import pytest
import torch
import transformers

from atom.distributed import TensorParallelGroup
from atom.forward_context import AttentionMetadata, forward_context
from atom.fusions import Fusions
from atom.models import llama


@pytest.mark.parametrize("num_tokens", [1, 3])  # the batch-1 GEMV kernel, the dot kernel
@pytest.mark.parametrize("first_layer", [True, False])
@pytest.mark.parametrize("fusion", ["norm_gemv", "gemv_silu"])
def test_fused_layer_matches_unfused(monkeypatch, fusion, first_layer, num_tokens):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # use_triton: the interpreter on CPU
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = llama.LlamaDecoderLayer(config, 64, TensorParallelGroup.single())
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.2)
    hidden = torch.randn(num_tokens, 64)
    residual = None if first_layer else torch.randn(num_tokens, 64)
    positions = torch.arange(num_tokens)
    dense = AttentionMetadata(None, None, None, None, num_tokens, False)  # no cache: SDPA
    with torch.no_grad(), forward_context(dense, Fusions.none()):
        expected = layer(positions, hidden, residual)
    calls = []
    monkeypatch.setattr(llama, "_fused_kernels_on", lambda x: calls.append(x) or True)
    with torch.no_grad(), forward_context(dense, Fusions.only(fusion)):
        got = layer(positions, hidden, residual)
    assert calls, "the fused path did not run"
    torch.testing.assert_close(got[0], expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=1e-6)

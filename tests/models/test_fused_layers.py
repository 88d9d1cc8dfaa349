"""A Llama decoder layer with its GEMV fusions (atom/fusions.py: norm_gemv, gemv_silu) gives
the unfused layer's outputs: the fused paths run under the Triton interpreter here."""

import pytest
import torch
import transformers

from atom.distributed import TensorParallelGroup
from atom.forward_context import AttentionMetadata, forward_context
from atom.fusions import Fusions
from atom.kernels import gemv as gemv_module
from atom.kernels import gemv_policy
from atom.models import llama


@pytest.fixture(autouse=True)
def fused_gemv_policy():
    """Every one-row layer takes the Triton GEMV (ATOM_GEMV_POLICY=fused): these tests
    check the fused paths' outputs, whatever a timed trial would choose."""
    previous = gemv_policy.set_policy(gemv_policy.GemvPolicy("fused"))
    yield
    gemv_policy.set_policy(previous)


# compressed-tensors FP8 with one scale per output row (FP8_DYNAMIC's weights)
FP8_PER_ROW = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                        "dynamic": False, "strategy": "channel"},
        }
    },
}  # fmt: skip


def _random_layer(seed: int, fp8: bool = False) -> llama.LlamaDecoderLayer:
    """A small Llama decoder layer (hidden 64, 4 / 2 heads) with N(0, 0.2) weights; with
    ``fp8`` its linears hold e4m3 weights and a float32 scale per row."""
    extra = dict(quantization_config=FP8_PER_ROW) if fp8 else {}
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    layer = llama.LlamaDecoderLayer(config, 64, TensorParallelGroup.single(), "model.layers.0")
    with torch.no_grad():
        for param in layer.parameters():
            if param.dtype == torch.float8_e4m3fn:  # ~N(0, 0.2) after the scale
                param.copy_((torch.randn(param.shape) * 40).clamp(-448, 448).to(param.dtype))
            else:
                param.normal_(0.0, 0.2)
        for name, buffer in layer.named_buffers():
            if name.endswith("weight_scale"):
                buffer.copy_(0.005 * (0.5 + torch.rand(buffer.shape)))
    return layer


@pytest.fixture
def fp8_kernel_path(monkeypatch):
    """FP8 layers take their CUDA path on CPU (atom/kernels/fp8_linear.py, weight-only as
    the fused GEMVs), not the CPU reference's emulated FP8 activations."""
    from atom.kernels.fp8_linear import fp8_linear
    from atom.models.quantization.fp8 import Fp8LinearMethod

    def cuda_apply(self, layer, x, bias=None):
        return fp8_linear(x, layer.weight, layer.weight_scale, layer.weight_block, bias)

    monkeypatch.setattr(Fp8LinearMethod, "apply", cuda_apply)


@pytest.mark.parametrize("num_tokens", [1, 3])  # the batch-1 GEMV; 3 rows: the unfused path
@pytest.mark.parametrize("first_layer", [True, False])
@pytest.mark.parametrize("fusion", ["norm_gemv", "gemv_silu"])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_layer_matches_unfused(
    monkeypatch, fp8_kernel_path, fusion, first_layer, num_tokens, fp8
):
    """Dense, or FP8 with a scale per row: the fused GEMVs read the e4m3 weight and its
    scales, against the FP8 linear and the separate kernels."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # use_triton: the interpreter on CPU
    layer = _random_layer(seed=0, fp8=fp8)
    hidden = torch.randn(num_tokens, 64)
    residual = None if first_layer else torch.randn(num_tokens, 64)
    positions = torch.arange(num_tokens)
    dense = AttentionMetadata(None, None, None, None, num_tokens, False)  # no cache: SDPA
    with torch.no_grad(), forward_context(dense, Fusions.none()):
        expected = layer(positions, hidden, residual)
    calls, launches = [], []
    monkeypatch.setattr(llama, "_fused_kernels_on", lambda x: calls.append(x) or True)
    real_launch = gemv_module._launch
    monkeypatch.setattr(
        gemv_module, "_launch", lambda *a, **k: launches.append(a) or real_launch(*a, **k)
    )
    with torch.no_grad(), forward_context(dense, Fusions.only(fusion)):
        got = layer(positions, hidden, residual)
    assert calls, "the fused path did not run"
    assert bool(launches) == (num_tokens == 1), "one row runs the Triton GEMV, more rows not"
    assert all((a[1].dtype == torch.float8_e4m3fn) == fp8 for a in launches)
    torch.testing.assert_close(got[0], expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("first_layer", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_rope_kv_epilogue_layer_matches_norm_gemv(monkeypatch, fp8_kernel_path, first_layer, fp8):
    """A batch-1 decode step over a paged cache: the qkv GEMV with RoPE + KV write in its
    epilogue (gemv_rope_kv) gives the outputs and the cache of norm_gemv's GEMV followed by
    the separate rotary and store (fp32, the interpreter on CPU); FP8 layers too, and
    there every fusion off as well (the FP8 linear, the norm, rotary and SiLU kernels)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    layer = _random_layer(seed=1, fp8=fp8)
    attn = layer.self_attn.attn
    history = torch.randn(2, 16, 2, 16)  # 2 blocks of 16 tokens, 2 kv heads, head_dim 16
    hidden, positions = torch.randn(1, 64), torch.tensor([20])
    residual = None if first_layer else torch.randn(1, 64)
    meta = AttentionMetadata(
        torch.tensor([20]), torch.tensor([21], dtype=torch.int32),
        torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1,
        True,
    )  # fmt: skip
    monkeypatch.setattr(llama, "_fused_kernels_on", lambda x: True)
    results = {}
    for name, fusions in (
        ("separate", Fusions.only("norm_gemv")),
        ("epilogue", Fusions.only("norm_gemv", "gemv_rope_kv")),
        ("unfused", Fusions.only("rope_kv_write")),
    ):
        attn.k_cache, attn.v_cache = history.clone(), history.clone()
        with torch.no_grad(), forward_context(meta, fusions):
            results[name] = (*layer(positions, hidden, residual), attn.k_cache, attn.v_cache)
    calls = []
    real = llama.gemv_rope_kv
    monkeypatch.setattr(llama, "gemv_rope_kv", lambda *a, **k: calls.append(a) or real(*a, **k))
    with torch.no_grad(), forward_context(meta, Fusions.only("norm_gemv", "gemv_rope_kv")):
        layer(positions, hidden, residual)
    assert calls, "the epilogue path did not run"
    assert (calls[0][1].dtype == torch.float8_e4m3fn) == fp8
    for got, want in zip(results["epilogue"], results["separate"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for got, want in zip(results["epilogue"], results["unfused"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.equal(results["epilogue"][2][1, 4], history[1, 4])  # slot 20 written

"""The qkv GEMV with RoPE + KV write in its epilogue (atom/kernels/gemv_rope_kv.py) against
its torch reference: the GEMV (or RMSNorm + GEMV) then rotary_kv_write_reference: the same q,
the same cache rows, nothing written for a padding slot, with and without the norm. CPU runs
the kernel under TRITON_INTERPRET=1 (conftest)."""

from __future__ import annotations

import pytest
import torch

from atom.kernels.gemv import GemvConfig
from atom.kernels.gemv_rope_kv import RopeKV, gemv_rope_kv, gemv_rope_kv_reference
from atom.models.layers import RotaryEmbedding

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(dtype, heads=(4, 2), head_dim=16, hidden=48, slot=5, position=7, seed=0):
    generator = torch.Generator().manual_seed(seed)
    nq, nkv = heads
    rows = (nq + 2 * nkv) * head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None, 64)
    caches = [torch.zeros(4, 4, nkv, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)]
    x, weight = randn(1, hidden), randn(rows, hidden) * 0.2

    def rope(k_cache, v_cache):
        return RopeKV(
            torch.tensor([position], device=DEVICE), rotary.cos.to(DEVICE), rotary.sin.to(DEVICE),
            k_cache, v_cache, torch.tensor([slot], device=DEVICE), nq, nkv, head_dim,
        )  # fmt: skip

    return x, weight, rope(*caches[:2]), rope(*caches[2:]), randn


# bf16 on a GPU only: the interpreter's bf16 rounding is not the GPU's (as tests/kernels/test_gemv.py)
@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("block_n", [1, 2, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_gemv_then_rotary_kv_write(dtype, norm, block_n, bias):
    """With a bias (Qwen2's qkv) the reference is F.linear with it, then the rotary."""
    x, weight, got_rope, want_rope, randn = _case(dtype)
    bias = randn(weight.shape[0]) if bias else None
    norm_args = None
    if norm:
        norm_args = (randn(1, x.shape[1]), randn(x.shape[1]), 1e-6)
    config = GemvConfig(block_n, 32, 4, 1)  # several K chunks, pairs of one and more heads
    from atom.kernels import gemv as gemv_module

    original = gemv_module.gemv_config
    gemv_module.gemv_config = lambda *args, **kwargs: config
    try:
        got = gemv_rope_kv(x, weight, got_rope, norm_args, bias=bias)
    finally:
        gemv_module.gemv_config = original
    want = gemv_rope_kv_reference(x, weight, want_rope, norm_args, bias)
    assert_rope_kv_close(got, want, got_rope, want_rope, dtype, norm)


def assert_rope_kv_close(got, want, got_rope, want_rope, dtype, norm: bool) -> None:
    """q (and with the norm x + residual, exactly) and both caches of `gemv_rope_kv`
    against its reference; only slot 5 written."""
    tolerance = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    if norm:
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # x + residual
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, **tolerance)
    for cache in ("k_cache", "v_cache"):
        a, b = getattr(got_rope, cache), getattr(want_rope, cache)
        torch.testing.assert_close(a, b, **tolerance)
        assert a.flatten(0, 1)[5].abs().sum() > 0  # the slot, written
        assert a.flatten(0, 1)[:5].abs().sum() == 0 == a.flatten(0, 1)[6:].abs().sum()


def test_a_padding_slot_writes_nothing_and_fits():
    x, weight, rope, _, _ = _case(torch.float32, slot=-1)
    q = gemv_rope_kv(x, weight, rope)
    assert q.shape == (1, 4 * 16)
    assert rope.k_cache.abs().sum() == 0 == rope.v_cache.abs().sum()
    assert rope.fits(x, weight)
    assert not rope.fits(torch.cat([x, x]), weight)  # two tokens: the separate kernels
    assert not rope.fits(x, weight[:-16])

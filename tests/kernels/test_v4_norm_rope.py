"""DeepSeek-V4's fused RMSNorm + interleaved rope (atom/kernels/v4_rope.py `norm_rope`)
against its torch reference, and the reference against the model's own ops
(`unweighted_rms_norm`, `FP32RMSNorm`, `apply_interleaved_rope_reference`; with
`round_normed`, DeepSeek-V4.1's `RMSNorm`): CPU interpreter, `gpu` variants on CUDA."""

import pytest
import torch

from atom.kernels.v4_rope import (
    apply_interleaved_rope_reference,
    norm_rope,
    norm_rope_reference,
    rope_tables,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
EPS = 1e-6


def _tables(half, device):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half)))
    return tuple(t.to(device) for t in rope_tables(inv_freq, 300))


# (heads, dim, rope channels, norm: None / "unweighted" / "weighted", inverse)
CASES = [
    (4, 32, 8, "unweighted", False),  # q: per-head norm, then rope
    (1, 48, 16, "weighted", False),  # kv: FP32RMSNorm, then rope (dim not a power of two)
    (3, 32, 8, None, True),  # the output's inverse rope
    (1, 24, 0, "weighted", False),  # q_a_norm: the norm only
    (16, 64, 64, None, False),  # the indexer's q: rope only, every channel
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,dim,rope,norm,inverse", CASES)
def test_norm_rope_matches_reference(device, dtype, heads, dim, rope, norm, inverse):
    g = torch.Generator().manual_seed(heads * dim + rope)
    tokens = 5
    x = (torch.randn(tokens, heads, dim + 3, generator=g) * 3)[..., :dim]  # strided rows
    x = x.to(device=device, dtype=dtype)
    positions = torch.randint(0, 300, (tokens,), generator=g).to(device)
    cos, sin = _tables(rope // 2, device) if rope else (None, None)
    weight = (torch.rand(dim, generator=g) + 0.5).to(device) if norm == "weighted" else None
    eps = EPS if norm else None
    got = norm_rope(x, positions, cos, sin, weight, eps, inverse)
    expected = norm_rope_reference(x, positions, cos, sin, weight, eps, inverse)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # Triton's interpreter truncates fp32 -> bf16 (the GPU rounds): ~2 ulps
        torch.testing.assert_close(got, expected, rtol=2.5e-2, atol=6e-2)  # inputs up to ~10


def test_reference_is_the_models_math():
    from atom.models.deepseek_v4 import FP32RMSNorm, unweighted_rms_norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 32, generator=g)
    positions = torch.tensor([0, 7, 250])
    cos_table, sin_table = _tables(4, "cpu")
    cos, sin = cos_table[positions], sin_table[positions]
    q = apply_interleaved_rope_reference(unweighted_rms_norm(x, EPS), cos, sin)
    assert torch.equal(norm_rope_reference(x, positions, cos_table, sin_table, None, EPS), q)
    norm = FP32RMSNorm(32, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32, generator=g) + 0.5)
    kv = apply_interleaved_rope_reference(norm(x[:, :1]), cos, sin)
    got = norm_rope_reference(x[:, :1], positions, cos_table, sin_table, norm.weight, EPS)
    assert torch.equal(got, kv)
    out = apply_interleaved_rope_reference(x, cos, -sin)
    assert torch.equal(norm_rope_reference(x, positions, cos_table, sin_table, inverse=True), out)


# V4.1's RMSNorm (the weight in x's dtype, the normed value rounded first): q_norm alone,
# kv_norm then rope, a dim that is not a power of two, every channel rotated
ROUNDED_CASES = [(1, 32, 0), (1, 40, 8), (1, 48, 16), (2, 24, 24)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,dim,rope", ROUNDED_CASES)
def test_norm_rope_round_normed_matches_reference(device, dtype, heads, dim, rope):
    g = torch.Generator().manual_seed(heads * dim + rope + 1)
    tokens = 5
    x = (torch.randn(tokens, heads, dim + 3, generator=g) * 3)[..., :dim]  # strided rows
    x = x.to(device=device, dtype=dtype)
    positions = torch.randint(0, 300, (tokens,), generator=g).to(device)
    cos, sin = _tables(rope // 2, device) if rope else (None, None)
    weight = (torch.rand(dim, generator=g) + 0.5).to(device=device, dtype=dtype)
    got = norm_rope(x, positions, cos, sin, weight, EPS, round_normed=True)
    expected = norm_rope_reference(x, positions, cos, sin, weight, EPS, round_normed=True)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # Triton's interpreter truncates fp32 -> bf16 (the GPU rounds): ~2 ulps
        torch.testing.assert_close(got, expected, rtol=2.5e-2, atol=6e-2)


def test_round_normed_reference_is_the_v41_norm():
    """`round_normed` is V4.1's RMSNorm bit for bit (bf16: where V4's order differs), then
    the same rope."""
    from atom.models.deepseek_v41 import RMSNorm

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(64, 1, 32, generator=g) * 3).bfloat16()
    positions = torch.arange(64)
    cos_table, sin_table = _tables(4, "cpu")
    norm = RMSNorm(32, EPS).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32, generator=g) + 0.5)
    expected = norm(x)
    got = norm_rope_reference(x, positions, None, None, norm.weight, EPS, round_normed=True)
    assert torch.equal(got, expected)
    assert not torch.equal(norm_rope_reference(x, positions, None, None, norm.weight, EPS), got)
    roped = apply_interleaved_rope_reference(expected, cos_table[positions], sin_table[positions])
    got = norm_rope_reference(x, positions, cos_table, sin_table, norm.weight, EPS,
                              round_normed=True)  # fmt: skip
    assert torch.equal(got, roped)


@pytest.mark.parametrize("device", DEVICES)
def test_v41_norm_fused_matches_module(device):
    """V4.1's `RMSNorm(x, fused=True)` (norm_rope without a rope: no positions) against the
    module's torch ops, on [T, D] rows (the compressor's latents)."""
    from atom.models.deepseek_v41 import RMSNorm

    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(40, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(40, generator=g) + 0.5)
    norm = norm.to(device)
    x = (torch.randn(7, 40, generator=g) * 3).to(device)
    got = norm(x, fused=True)
    assert got.shape == x.shape
    torch.testing.assert_close(got, norm(x), rtol=1e-5, atol=1e-5)

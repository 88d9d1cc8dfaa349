"""The batch-1 fused GEMVs (atom/kernels/gemv.py, gemv_rope_kv.py) with FP8 e4m3 weights and
one float32 scale per row (w8a16: the fp8 weight widened, each row's sum times its scale),
against torch on the dequantized weight: F.linear, RMSNorm + F.linear, SiLU * up, RoPE + the
KV write. CPU runs the kernels under TRITON_INTERPRET=1 (conftest); bf16 on a GPU only (the
interpreter's bf16 rounding is not the GPU's, as tests/kernels/test_gemv.py)."""

from __future__ import annotations

import pytest
import torch

from atom.kernels import gemv as gemv_module
from atom.kernels.fp8_linear import fp8_linear
from atom.kernels.gemv import (
    GemvConfig,
    fits_gemv,
    gemv,
    gemv_rms_norm,
    gemv_rms_norm_reference,
    gemv_silu_and_mul,
)
from atom.kernels.gemv_rope_kv import gemv_rope_kv, gemv_rope_kv_reference
from tests.kernels.test_gemv import ROW_CASES, TOLERANCE, exact_norm_linear
from tests.kernels.test_gemv_rope_kv import _case, assert_rope_kv_close

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
DTYPES = [
    (torch.float32, DEVICE),
    pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu),
]


def fp8_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale [rows, 1], the dequantized weight in float32)."""
    scale = weight.float().abs().amax(dim=1, keepdim=True) / 448
    quantized = (weight.float() / scale).to(FP8)
    return quantized, scale, quantized.float() * scale


def _inputs(in_features, out_features, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(1, in_features, generator=generator)).to(device, dtype)
    weight = torch.randn(out_features, in_features, generator=generator) / 8
    weight = weight * (1 + torch.rand(out_features, 1, generator=generator))  # scales differ
    fp8, scale, dequantized = fp8_per_row(weight)
    residual = torch.randn(1, in_features, generator=generator).to(device, dtype)
    norm_weight = (1 + torch.rand(in_features, generator=generator)).to(device, dtype)
    return x, fp8.to(device), scale.to(device), dequantized.to(device), residual, norm_weight


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("in_features, out_features, config", ROW_CASES)
def test_fp8_one_row_gemv_matches_the_dequantized_weight(
    in_features, out_features, config, dtype, device
):
    """Every epilogue / prologue of the batch-1 kernel with an FP8 weight: F.linear, SiLU *
    up and RMSNorm (+ residual) of the dequantized weight, within the bf16 fused tests'
    bounds; the residual stream is the same bytes."""
    x, fp8, scale, dequantized, residual, norm_weight = _inputs(
        in_features, out_features, dtype, device, in_features + config.block_n
    )
    tol = TOLERANCE[dtype]
    linear = torch.nn.functional.linear(x.double(), dequantized.double()).to(dtype)
    torch.testing.assert_close(gemv(x, fp8, config, weight_scale=scale), linear, atol=tol, rtol=tol)
    gate, up = linear.double().chunk(2, dim=-1)
    silu = (torch.nn.functional.silu(gate) * up).to(dtype)
    got = gemv_silu_and_mul(x, fp8, config, weight_scale=scale)
    torch.testing.assert_close(got, silu, atol=tol, rtol=tol)
    for silu_mul in (False, True):
        for res in (None, residual):
            args = (x, res, norm_weight, 1e-5)
            out, new_residual = gemv_rms_norm(*args, fp8, silu_mul, config, weight_scale=scale)
            expected = exact_norm_linear(*args, dequantized.to(torch.float64), silu_mul)
            torch.testing.assert_close(out, expected.to(dtype), atol=tol, rtol=tol)
            expected_residual = gemv_rms_norm_reference(*args, dequantized.to(dtype), silu_mul)[1]
            assert torch.equal(new_residual, expected_residual)


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("config", [GemvConfig(1, 64, 1, 1), GemvConfig(16, 64, 4, 3)])
def test_fp8_one_row_gemv_equals_the_unfused_fp8_path(config, dtype, device):
    """The fused FP8 paths against what a layer runs without them: the FP8 GEMV of
    atom/kernels/fp8_linear.py after the reference RMSNorm, with a bias (Qwen2's qkv), and
    the references of the fused functions (more rows, no Triton) dequantize as it does."""
    x, fp8, scale, dequantized, residual, norm_weight = _inputs(
        200, 130, dtype, device, config.block_n
    )
    bias = torch.randn(130, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    tol = TOLERANCE[dtype]
    block = (1, 200)
    unfused = fp8_linear(x, fp8, scale, block, bias)
    torch.testing.assert_close(gemv(x, fp8, config, bias, scale), unfused, atol=tol, rtol=tol)
    linear = (x.double() @ dequantized.double().T + bias.double()).to(dtype)  # exact
    torch.testing.assert_close(unfused, linear, atol=tol, rtol=tol)
    if dtype == torch.float32:
        # the torch reference widens the weight to x's dtype before F.linear: in bf16 that
        # rounds every dequantized weight, where both kernels sum the fp8 products in fp32
        # (an H200 run: 0.022 from the kernels at one output of 130, a cancelling sum)
        reference = gemv_module.gemv_reference(x, fp8, bias, scale)
        torch.testing.assert_close(reference, unfused, atol=tol, rtol=tol)
    args = (x, residual, norm_weight, 1e-5, fp8, False)
    out, _ = gemv_rms_norm(*args, config=config, bias=bias, weight_scale=scale)
    if dtype == torch.float32:  # the unfused layer: the RMSNorm's row, then the FP8 GEMV
        h, _ = gemv_rms_norm_reference(x, residual, norm_weight, 1e-5, torch.eye(200).to(x))
        torch.testing.assert_close(out, fp8_linear(h, fp8, scale, block, bias), atol=tol, rtol=tol)
    # The fused kernel never rounds the normalised row (test_gemv.exact_norm_linear): in
    # bf16 it is checked against the exact value, as the dense norm GEMV is; the unfused
    # layer's bf16 row differs from it by that rounding (an H200 run: 0.022 at one output
    # of 130, a cancelling sum).
    h = (x.float() + residual.float()).to(dtype).double()  # the sum both paths round
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight.double()
    exact = normed @ dequantized.double().T + bias.double()
    torch.testing.assert_close(out, exact.to(dtype), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("block_n", [1, 8])
def test_fp8_gemv_rope_kv_matches_the_dequantized_weight(dtype, norm, block_n, monkeypatch):
    """The qkv GEMV with RoPE + KV write in its epilogue, FP8 weight: q and the cache rows of
    the reference on the dequantized weight (torch GEMV or RMSNorm + GEMV, then the
    rotary and the store)."""
    x, weight, got_rope, want_rope, randn = _case(dtype)
    fp8, scale, dequantized = fp8_per_row(weight.float().cpu())
    fp8, scale, dequantized = fp8.to(x.device), scale.to(x.device), dequantized.to(x.device, dtype)
    norm_args = (randn(1, x.shape[1]), randn(x.shape[1]), 1e-6) if norm else None
    config = GemvConfig(block_n, 32, 4, 1)  # several K chunks, pairs of one and more heads
    monkeypatch.setattr(gemv_module, "gemv_config", lambda *args, **kwargs: config)
    got = gemv_rope_kv(x, fp8, got_rope, norm_args, weight_scale=scale)
    want = gemv_rope_kv_reference(x, dequantized, want_rope, norm_args)
    assert_rope_kv_close(got, want, got_rope, want_rope, dtype, norm)


def test_fits_gemv_takes_fp8_only_with_one_scale_per_row():
    x = torch.zeros(1, 256)
    weight = torch.zeros(32, 256).to(FP8)
    assert fits_gemv(x, weight, torch.ones(32, 1))
    assert not fits_gemv(x, weight)  # no scale: the weight must have x's dtype
    assert not fits_gemv(x, weight, torch.ones(32, 2))  # block scales: the FP8 GEMV's
    assert not fits_gemv(x, weight, torch.ones(32, 1, dtype=torch.float16))
    assert not fits_gemv(x, torch.zeros(32, 256), torch.ones(32, 1))  # not fp8
    assert not fits_gemv(torch.zeros(2, 256), weight, torch.ones(32, 1))  # one row only


def _bf16_ulp(v: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bf16 (8 significant bits) at v or at its rounding,
    the larger (a value just under a power of two rounds up to the coarser spacing)."""
    top = torch.maximum(v.abs(), rounded.abs()).clamp_min(1e-30)
    return torch.exp2(torch.floor(torch.log2(top)) - 7)


def _kernel_rounded_exact(x, residual, norm_weight, eps, weight, silu_mul, norm):
    """(value, bound): the one-row kernel's rounding points applied to the exact float64
    sums (the normalised row unrounded, as the kernel keeps it; gate and up rounded to bf16,
    then the SiLU, then the product), and how far the kernel may be from it: its fp32 sums
    differ from the exact ones in the last bits, which flips an intermediate's bf16 rounding
    by one unit where a sum lies at a rounding boundary; the bound allows one such flip of
    each intermediate (SiLU's slope is at most 1.1) and of the output, plus the float32
    sums' own error (2^-18 of the sum of |products|: what matters for sums near zero)."""
    h = x.double()
    if norm:
        h = (x.float() + residual.float()).to(x.dtype).double()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    sums = h @ weight.double().T
    # the fp32 sums' own error (any order): a few float32 units of the sum of |products|
    summing = 2.0**-18 * (h.abs() @ weight.double().abs().T)
    if not silu_mul:
        value = sums.to(torch.bfloat16).double()
        return value, _bf16_ulp(sums, value) + summing
    gate, up = sums.chunk(2, dim=-1)
    summing_gate, summing_up = summing.chunk(2, dim=-1)
    gate_b, up_b = gate.to(torch.bfloat16).double(), up.to(torch.bfloat16).double()
    silu_exact = torch.nn.functional.silu(gate_b)
    silu = silu_exact.to(torch.bfloat16).double()
    product = silu * up_b
    value = product.to(torch.bfloat16).double()
    bound = (
        1.1 * (_bf16_ulp(gate, gate_b) + summing_gate) * up_b.abs()
        + (_bf16_ulp(up, up_b) + summing_up) * silu.abs()
        + _bf16_ulp(silu_exact, silu) * up_b.abs() + _bf16_ulp(product, value)
    )  # fmt: skip
    return value, bound


@pytest.mark.gpu
def test_fp8_policy_candidates_compute_their_shape_on_gpu():
    """Every tile the GEMV policy may choose for an FP8 site computes the 8B (and a 1B)
    qkv and gate_up shapes right (bf16 x, e4m3 weight, a scale per row)."""
    from atom.kernels.gemv_policy import GemvSite, candidates

    generator = torch.Generator("cuda").manual_seed(0)
    for k, n in [(4096, 6144), (4096, 28672), (2048, 3072), (2048, 16384)]:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=generator)
        weight = torch.randn(n, k, device="cuda", generator=generator) / k**0.5
        fp8, scale, dequantized = fp8_per_row(weight)
        norm_weight = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        for silu_mul, norm in ((False, True), (True, True), (True, False)):
            site = GemvSite(k, n, silu_mul, norm, "bfloat16", weight_dtype="float8_e4m3fn")
            expected, bound = _kernel_rounded_exact(
                x, residual, norm_weight, 1e-5, dequantized, silu_mul, norm
            )
            for config in candidates(site):
                if norm:
                    args = (x, residual, norm_weight, 1e-5, fp8, silu_mul, config)
                    got = gemv_rms_norm(*args, weight_scale=scale)[0]
                else:
                    got = gemv_silu_and_mul(x, fp8, config, weight_scale=scale)
                error = (got.double() - expected).abs()
                worst = int((error - bound).argmax())
                assert bool((error <= bound).all()), (
                    f"{site.label()} {config}: output {worst} is {got[0, worst].item()}, the "
                    f"kernel-rounded exact value {expected[0, worst].item()}, bound "
                    f"{bound[0, worst].item()}"
                )

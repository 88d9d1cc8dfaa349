"""gemv and gemv_silu_and_mul (small-batch Triton GEMVs) against F.linear (+ silu * up)."""

import pytest
import torch

from atom.kernels.gemv import (
    GEMV_MAX_ROWS,
    fits_gemv,
    gemv,
    gemv_reference,
    gemv_rms_norm,
    gemv_rms_norm_reference,
    gemv_silu_and_mul,
    gemv_silu_and_mul_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    (torch.float32, DEVICE),
    pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu),
]
# fp32: a different summation order; bf16: the rounded outputs may differ by one unit
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize(
    "rows, in_features, out_features",
    [(1, 64, 48), (3, 200, 130), (GEMV_MAX_ROWS, 96, 256)],  # partial tiles, odd sizes
)
def test_gemv_matches_linear(rows, in_features, out_features, dtype, device):
    generator = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features + 8, generator=generator).to(device, dtype)[:, :in_features]
    weight = (torch.randn(out_features, in_features, generator=generator) / 8).to(device, dtype)
    assert fits_gemv(x, weight)  # strided rows are fine
    tol = TOLERANCE[dtype]
    expected = gemv_reference(x, weight)
    torch.testing.assert_close(gemv(x, weight), expected, atol=tol, rtol=tol)
    expected = gemv_silu_and_mul_reference(x, weight)
    torch.testing.assert_close(gemv_silu_and_mul(x, weight), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("rows, hidden, out_features", [(1, 576, 96), (5, 200, 48)])
def test_gemv_rms_norm_matches_norm_then_linear(
    rows, hidden, out_features, silu_mul, with_residual, dtype, device
):
    generator = torch.Generator().manual_seed(rows + hidden + silu_mul)
    x = (4 * torch.randn(rows, hidden, generator=generator)).to(device, dtype)
    residual = torch.randn(rows, hidden, generator=generator).to(device, dtype)
    residual = residual if with_residual else None
    norm_weight = (1 + torch.rand(hidden, generator=generator)).to(device, dtype)
    weight = (torch.randn(out_features, hidden, generator=generator) / 8).to(device, dtype)
    args = (x, residual, norm_weight, 1e-5, weight, silu_mul)
    out, new_residual = gemv_rms_norm(*args)
    expected, expected_residual = gemv_rms_norm_reference(*args)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    assert torch.equal(new_residual, expected_residual)  # the same rounded sum, or x itself


@pytest.mark.gpu
def test_gemv_silu_and_mul_llama_1b_shapes():
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(2 * 8192, 2048, device="cuda", dtype=torch.bfloat16) / 45
    got = gemv_silu_and_mul(x, gate_up)
    torch.testing.assert_close(got, gemv_silu_and_mul_reference(x, gate_up), atol=2e-2, rtol=2e-2)
    lm_head = torch.randn(128256, 2048, device="cuda", dtype=torch.bfloat16) / 45
    torch.testing.assert_close(gemv(x, lm_head), x @ lm_head.T, atol=2e-2, rtol=2e-2)


def test_fits_gemv_refuses_what_it_cannot_take():
    weight = torch.zeros(32, 16)
    assert not fits_gemv(torch.zeros(GEMV_MAX_ROWS + 1, 16), weight)
    assert not fits_gemv(torch.zeros(0, 16), weight)
    assert not fits_gemv(torch.zeros(2, 16, dtype=torch.float16), weight)
    assert not fits_gemv(torch.zeros(16, 2).T, weight)  # columns not unit-stride

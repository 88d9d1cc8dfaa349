"""gemv and gemv_silu_and_mul (small-batch Triton GEMVs) against F.linear (+ silu * up).

One row runs the batch-1 kernel (no tl.dot); more rows fall back to the references."""

import pytest
import torch

from atom.kernels.gemv import (
    GemvConfig,
    fits_gemv,
    gemv,
    gemv_reference,
    gemv_rms_norm,
    gemv_rms_norm_reference,
    gemv_silu_and_mul,
    gemv_silu_and_mul_reference,
)
from atom.kernels.gemv import gemv_config as config_for

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
    [(1, 64, 48), (1, 200, 130), (3, 200, 130), (16, 96, 256)],  # partial tiles, odd sizes
)
def test_gemv_matches_linear(rows, in_features, out_features, dtype, device):
    """One row: the kernel within rounding of F.linear; more rows are F.linear itself."""
    generator = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features + 8, generator=generator).to(device, dtype)[:, :in_features]
    weight = (torch.randn(out_features, in_features, generator=generator) / 8).to(device, dtype)
    assert fits_gemv(x, weight) == (rows == 1)  # a strided row is fine
    tol = TOLERANCE[dtype] if rows == 1 else 0.0
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
    tol = 0.0  # more rows: the reference itself
    if rows == 1:  # the one-row kernel: against the exact math (exact_norm_linear)
        expected, tol = exact_norm_linear(*args), TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    assert torch.equal(new_residual, expected_residual)  # the same rounded sum, or x itself


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("config", [GemvConfig(1, 64, 1, 1), GemvConfig(16, 64, 4, 3)])
def test_one_row_gemv_adds_the_bias_as_linear(config, dtype, device):
    """A bias (Qwen2's qkv): F.linear(x, weight, bias), with and without the norm; the
    partial last tile of rows (130 % 16) reads no bias past its end."""
    generator = torch.Generator().manual_seed(config.block_n)
    x = (2 * torch.randn(1, 200, generator=generator)).to(device, dtype)
    weight = (torch.randn(130, 200, generator=generator) / 8).to(device, dtype)
    bias = torch.randn(130, generator=generator).to(device, dtype)
    residual = torch.randn(1, 200, generator=generator).to(device, dtype)
    norm_weight = (1 + torch.rand(200, generator=generator)).to(device, dtype)
    tol = TOLERANCE[dtype]
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(gemv(x, weight, config, bias), expected.to(dtype), atol=tol, rtol=tol)
    args = (x, residual, norm_weight, 1e-5, weight, False)
    out, _ = gemv_rms_norm(*args, config=config, bias=bias)
    expected = exact_norm_linear(*args).double() + bias.double()
    torch.testing.assert_close(out, expected.to(dtype), atol=tol, rtol=tol)
    reference, _ = gemv_rms_norm_reference(*args, bias=bias)  # more rows, no Triton
    torch.testing.assert_close(reference, expected.to(dtype), atol=tol, rtol=tol)


def exact_norm_linear(x, residual, norm_weight, eps, weight, silu_mul):
    """The norm-then-linear math in float64 from the same inputs (x + residual rounded to
    x's dtype, as both paths keep it): the one-row kernel never rounds the normalised row,
    so it is checked against the exact value, not against the reference's extra rounding."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    h = h.double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    out = normed @ weight.double().T
    if silu_mul:
        gate, up = out.chunk(2, dim=-1)
        out = torch.nn.functional.silu(gate) * up
    return out.to(x.dtype)


# batch-1 geometries: one output row per program (BLOCK_N 1), a partial last tile of rows
# (130 % 16, SiLU's 65 % 16) and of K (136 % 64, 200 % 64), several K chunks per program
ROW_CASES = [
    (136, 10, GemvConfig(1, 64, 1, 1)),
    (200, 130, GemvConfig(16, 64, 4, 3)),
    (576, 96, GemvConfig(4, 128, 2, 2)),
]


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("in_features, out_features, config", ROW_CASES)
def test_one_row_gemv_matches_linear(in_features, out_features, config, dtype, device):
    """Batch-1 kernel, every epilogue / prologue, against the torch references."""
    generator = torch.Generator().manual_seed(in_features + config.block_n)
    x = (2 * torch.randn(1, in_features, generator=generator)).to(device, dtype)
    weight = (torch.randn(out_features, in_features, generator=generator) / 8).to(device, dtype)
    residual = torch.randn(1, in_features, generator=generator).to(device, dtype)
    norm_weight = (1 + torch.rand(in_features, generator=generator)).to(device, dtype)
    tol = TOLERANCE[dtype]
    got, expected = gemv(x, weight, config), gemv_reference(x, weight)
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    got = gemv_silu_and_mul(x, weight, config)
    torch.testing.assert_close(got, gemv_silu_and_mul_reference(x, weight), atol=tol, rtol=tol)
    for silu_mul in (False, True):
        for res in (None, residual):
            args = (x, res, norm_weight, 1e-5, weight, silu_mul)
            out, new_residual = gemv_rms_norm(*args, config=config)
            expected_residual = gemv_rms_norm_reference(*args)[1]
            torch.testing.assert_close(out, exact_norm_linear(*args), atol=tol, rtol=tol)
            assert torch.equal(new_residual, expected_residual)


def test_gemv_config_policy_tile_then_heuristic(tmp_path):
    """A shape the GEMV policy measured gets the tile it chose, any other the heuristic's."""
    from atom.kernels import gemv_policy

    site = gemv_policy.GemvSite(2048, 8192, True, False, "bfloat16")
    policy = gemv_policy.GemvPolicy("measure", None)
    device = torch.device("cuda")
    key = ("cuda-less", "triton", "torch", 2048, 8192, True, False, "bfloat16", True)
    policy._key = lambda s, d: key if s == site else ("other",)  # no device to name here
    policy.choices[key] = gemv_policy.GemvChoice(GemvConfig(2, 1024, 8, 4), "made up", "measured")
    previous = gemv_policy.set_policy(policy)
    try:
        assert config_for(2048, 8192, True, False, device=device) == GemvConfig(2, 1024, 8, 4)
        assert config_for(2048, 8192, True, False, on_gpu=False) != GemvConfig(2, 1024, 8, 4)
        assert config_for(2048, 8192, True, True, device=device) != GemvConfig(2, 1024, 8, 4)
    finally:
        gemv_policy.set_policy(previous)
    for in_features, out_features in [(576, 576), (8192, 2048), (2048, 128256), (64, 8)]:
        config = config_for(in_features, out_features, False, False)
        assert config.block_n in (1, 2, 4, 8, 16) and 128 <= config.block_k <= 2048
        assert config.num_stages >= 1
    # few rows -> small BLOCK_N (more programs); many rows -> 16
    assert config_for(576, 576, False, False).block_n == 1
    assert config_for(2048, 128256, False, False).block_n == 16


@pytest.mark.gpu
def test_one_row_gemv_policy_candidates_on_gpu():
    """Every tile the GEMV policy may choose computes its shape right, for the layers of
    the benchmark's shape matrix and two others (bf16)."""
    from atom.kernels.gemv_policy import GemvSite, candidates

    generator = torch.Generator("cuda").manual_seed(0)
    shapes = [(2048, 3072), (576, 960), (4096, 6144), (3584, 4608), (896, 1152), (5120, 7680)]
    shapes += [(2048, 16384), (4096, 28672), (8192, 2048), (14336, 4096), (18944, 3584)]
    for k, n in shapes:
        for silu_mul, norm in ((False, False), (True, False), (False, True), (True, True)):
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=generator)
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator)
            weight /= k**0.5
            for config in candidates(GemvSite(k, n, silu_mul, norm, "bfloat16")):
                if norm:
                    norm_weight = torch.ones(k, device="cuda", dtype=torch.bfloat16)
                    args = (x, torch.randn_like(x), norm_weight, 1e-5, weight, silu_mul)
                    got = gemv_rms_norm(*args, config=config)[0]
                    expected = gemv_rms_norm_reference(*args)[0]
                elif silu_mul:
                    got = gemv_silu_and_mul(x, weight, config)
                    expected = gemv_silu_and_mul_reference(x, weight)
                else:
                    got, expected = gemv(x, weight, config), gemv_reference(x, weight)
                msg = f"{k}x{n} silu={silu_mul} norm={norm} {config}"
                torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2, msg=msg)


@pytest.mark.gpu
def test_gemv_silu_and_mul_llama_1b_shapes():
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(2 * 8192, 2048, device="cuda", dtype=torch.bfloat16) / 45
    got = gemv_silu_and_mul(x, gate_up)
    torch.testing.assert_close(got, gemv_silu_and_mul_reference(x, gate_up), atol=2e-2, rtol=2e-2)
    lm_head = torch.randn(128256, 2048, device="cuda", dtype=torch.bfloat16) / 45
    torch.testing.assert_close(gemv(x, lm_head), x @ lm_head.T, atol=2e-2, rtol=2e-2)
    down = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16) / 90
    h = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(gemv(h, down), h @ down.T, atol=2e-2, rtol=2e-2)
    x = torch.randn(1, 576, device="cuda", dtype=torch.bfloat16)  # a SmolLM2 shape
    gate_up = torch.randn(2 * 1536, 576, device="cuda", dtype=torch.bfloat16) / 24
    got, want = gemv_silu_and_mul(x, gate_up), gemv_silu_and_mul_reference(x, gate_up)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_fits_gemv_refuses_what_it_cannot_take():
    weight = torch.zeros(32, 16)
    assert fits_gemv(torch.zeros(1, 16), weight)
    assert not fits_gemv(torch.zeros(2, 16), weight)  # one row only
    assert not fits_gemv(torch.zeros(0, 16), weight)
    assert not fits_gemv(torch.zeros(1, 16, dtype=torch.float16), weight)
    assert not fits_gemv(torch.zeros(1, 32)[:, ::2], weight)  # columns not unit-stride


@pytest.mark.parametrize(
    "dtype, device",
    [(torch.float16, DEVICE), pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_float32_out_is_the_float32_product(rows, dtype, device):
    """``out_dtype=float32`` (V4.1's pooled compressor projections): the fp32 sums of the
    exact products, as F.linear on the widened inputs, never rounded to x's dtype; more
    rows are that F.linear itself."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=generator).to(dtype)
    weight = (torch.randn(130, 200, generator=generator) / 8).to(dtype)
    expected = torch.nn.functional.linear(x.double(), weight.double()).float()
    out = gemv(x.to(device), weight.to(device), out_dtype=torch.float32)
    assert out.dtype == torch.float32
    # fp32 summation order only: far below one fp16 / bf16 unit of the output
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)
    assert (out.cpu() - expected.to(dtype).float()).abs().max() > 1e-4  # not rounded to x's

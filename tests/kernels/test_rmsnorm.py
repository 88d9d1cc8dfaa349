"""rms_norm: the Triton kernel against its torch reference (HF LlamaRMSNorm numerics)."""

import pytest
import torch

from atom.kernels import rms_norm, rms_norm_reference

# fp32 (and fp16) run the kernel on CUDA when there is one, else under TRITON_INTERPRET=1
# (conftest). bf16 only on CUDA: the interpreter rounds float -> bf16 toward zero.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    (torch.float32, DEVICE),
    (torch.float16, DEVICE),
    pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu),
]
# The sum of squares is reduced in another order than torch's, so the fp32 scale differs
# in its last bits; in fp16/bf16 that can flip the rounding of `normed` and then of the
# weight product: up to about 2 ulps of the output dtype. The residual sum is exact.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _make_inputs(num_tokens, hidden, dtype, device, strided):
    generator = torch.Generator().manual_seed(num_tokens * 7 + hidden)
    width = hidden + 32 if strided else hidden  # strided: rows of a wider buffer
    x = torch.randn(num_tokens, width, generator=generator).to(device, dtype)[:, :hidden]
    residual = torch.randn(num_tokens, width, generator=generator).to(device, dtype)[:, :hidden]
    weight = (1 + 0.2 * torch.randn(hidden, generator=generator)).to(device, dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 576, 2048])
# 67 rows: several programs at every width (16, 4 and 2 rows each), the last one part-masked
@pytest.mark.parametrize("num_tokens", [1, 7, 67])
def test_rms_norm_matches_reference(num_tokens, hidden, with_residual, dtype, device):
    x, residual, weight = _make_inputs(num_tokens, hidden, dtype, device, strided=hidden == 576)
    x_before, residual_before = x.clone(), residual.clone()
    eps = 1e-5
    if with_residual:
        out, new_residual = rms_norm(x, weight, eps, residual)
        expected, expected_residual = rms_norm_reference(x, weight, eps, residual)
        torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
    else:
        out = rms_norm(x, weight, eps)
        expected = rms_norm_reference(x, weight, eps)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    # Out of place: the inputs are untouched.
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)
    torch.testing.assert_close(residual, residual_before, rtol=0, atol=0)


def test_rms_norm_keeps_leading_dims_and_promotes_to_weight_dtype():
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    x = x.to(torch.float16)
    weight = torch.rand(64, device=DEVICE) + 0.5  # fp32 weight: torch promotes the product
    out = rms_norm(x, weight, 1e-6)
    expected = rms_norm_reference(x, weight, 1e-6)
    assert out.shape == (2, 5, 64) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)


def test_rms_norm_empty():
    x = torch.empty(0, 64, device=DEVICE)
    out, new_residual = rms_norm(x, torch.ones(64, device=DEVICE), 1e-6, x)
    assert out.shape == (0, 64) and new_residual.shape == (0, 64)


@pytest.mark.parametrize("dtype, device", DTYPES)
def test_offset_rms_norm_matches_reference_and_hf(dtype, device):
    """offset=True (Qwen3-Next): the kernel against the reference, the reference against HF
    Qwen3NextRMSNorm (fp32 normalisation times 1 + w in fp32, rounded once) exactly."""
    x, residual, weight = _make_inputs(7, 64, dtype, device, strided=True)
    weight = weight - 1  # a checkpoint's w: the scale is 1 + w
    out, new_residual = rms_norm(x, weight, 1e-6, residual, offset=True)
    expected, expected_residual = rms_norm_reference(x, weight, 1e-6, residual, offset=True)
    assert out.dtype == dtype
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    norm = hf.Qwen3NextRMSNorm(64, eps=1e-6).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        torch.testing.assert_close(expected, norm(x + residual), rtol=0, atol=0)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 576, 2048])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rms_norm_cpu_equals_reference(num_tokens, hidden, with_residual):
    """The CPU engine's two-op form gives the reference's exact fp32 bytes; other dtypes
    take the reference itself."""
    from atom.kernels.rmsnorm import rms_norm_cpu

    x, residual, weight = _make_inputs(num_tokens, hidden, torch.float32, "cpu", strided=True)
    if with_residual:
        out, new_residual = rms_norm_cpu(x, weight, 1e-6, residual)
        expected, expected_residual = rms_norm_reference(x, weight, 1e-6, residual)
        assert torch.equal(new_residual, expected_residual)
    else:
        out, expected = rms_norm_cpu(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)
    assert torch.equal(out, expected)
    half = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    assert torch.equal(rms_norm_cpu(*half, 1e-6), rms_norm_reference(*half, 1e-6))

"""silu_and_mul (F.silu(gate) * up) and sigmoid_gate (x * sigmoid(gate)): the Triton kernels
against their torch references."""

import pytest
import torch

from atom.kernels import silu_and_mul, silu_and_mul_reference
from atom.kernels.activation import sigmoid_gate, sigmoid_gate_reference

# fp32 (and fp16) run the kernel on CUDA when there is one, else under TRITON_INTERPRET=1
# (conftest). bf16 only on CUDA: the interpreter rounds float -> bf16 toward zero.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    (torch.float32, DEVICE),
    (torch.float16, DEVICE),
    pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu),
]
# exp differs from torch's in the last fp32 bits; in fp16/bf16 that can flip the rounding
# of silu(gate) and then of the product: up to about 2 ulps of the output dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize(
    "num_tokens, intermediate, strided",
    [
        (1, 64, False),
        (7, 576, True),
        (300, 2048, False),
        (300, 1000, True),  # not a power of 2
        (3, 8192, False),  # Llama-3.2-1B: two column tiles per row
    ],
)
def test_silu_and_mul_matches_reference(num_tokens, intermediate, strided, dtype, device):
    generator = torch.Generator().manual_seed(num_tokens + intermediate)
    width = 2 * intermediate + (16 if strided else 0)  # strided: rows of a wider buffer
    x = 3 * torch.randn(num_tokens, width, generator=generator)
    x = x.to(device, dtype)[:, : 2 * intermediate]
    x_before = x.clone()
    out = silu_and_mul(x)
    expected = silu_and_mul_reference(x)
    assert out.shape == (num_tokens, intermediate) and out.dtype == dtype
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter
def test_silu_and_mul_keeps_leading_dims_and_handles_extremes():
    x = torch.tensor([[-1000.0, -20.0, 0.0, 20.0, 1000.0, 2.0, 3.0, 4.0, 5.0, 6.0]], device=DEVICE)
    x = x.reshape(1, 1, 10)
    out = silu_and_mul(x)
    assert out.shape == (1, 1, 5)
    torch.testing.assert_close(out, silu_and_mul_reference(x), rtol=1e-5, atol=1e-5)


def test_silu_and_mul_empty():
    assert silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("limit", [None, 0.7])
@pytest.mark.parametrize("num_tokens, intermediate", [(1, 48), (5, 300)])
def test_clamped_silu_and_mul_matches_hand_clamped_swiglu(num_tokens, intermediate, limit,
                                                          dtype, device):  # fmt: skip
    """DeepSeek-V4's SwiGLU: gate clamped to at most `limit`, up to [-limit, limit]."""
    from atom.kernels.activation import clamped_silu_and_mul

    g = torch.Generator().manual_seed(num_tokens)
    gate_up = (torch.randn(num_tokens, 2 * intermediate + 5, generator=g) * 2).to(device, dtype)
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate : 2 * intermediate]  # strided
    got = clamped_silu_and_mul(gate, up, limit)
    g32, u32 = gate.float(), up.float()
    if limit is not None:
        g32, u32 = torch.minimum(g32, torch.tensor(limit)), u32.clamp(-limit, limit)
        assert float(got.float().abs().max()) <= limit * max(limit, 1) + 1e-3
    expected = (g32 * torch.sigmoid(g32) * u32).to(dtype)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sigmoid_gate_matches_model_ops(dtype):
    """``x * sigmoid(gate)`` on a strided gate (the second half of each head of a q_proj
    output), against the model's ops: fp32 to the last bits, 16-bit within a last bit (exp;
    the interpreter truncates where the GPU rounds)."""
    device = DEVICE if dtype != torch.bfloat16 or DEVICE == "cuda" else "cpu"
    g = torch.Generator().manual_seed(4)
    q_gate = (torch.randn(3, 4, 2 * 24, generator=g) * 3).to(device, dtype)
    gate = q_gate[..., 24:]
    x = torch.randn(3, 4 * 24, generator=g).to(device, dtype)
    expected = x * torch.sigmoid(gate.reshape(3, -1))
    assert torch.equal(sigmoid_gate_reference(x, gate), expected)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(sigmoid_gate(x, gate), expected, **tolerance)

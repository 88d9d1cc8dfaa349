"""apply_rotary: the Triton kernel against its torch reference (neox rotate_half)."""

import pytest
import torch

from atom.kernels import apply_rotary, apply_rotary_reference
from atom.models.layers import RotaryEmbedding

# fp32 (and fp16) run the kernel on CUDA when there is one, else under TRITON_INTERPRET=1
# (conftest). bf16 only on CUDA: the interpreter rounds float -> bf16 toward zero.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    (torch.float32, DEVICE),
    (torch.float16, DEVICE),
    pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu),
]
# The kernel computes x * cos + rotate_half(x) * sin in fp32 and rounds once; torch rounds
# each product and the sum. That differs by up to about one ulp of the largest outputs
# (randn inputs: |out| < 16), more than an ulp of a small output where the sum cancels, so
# atol is one ulp at 16: 2^-4 for bf16, 2^-7 for fp16 (measured: at most half of that).
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2.0**-7, torch.bfloat16: 2.0**-4}
MAX_POSITION = 4096


def _make_inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, fused):
    generator = torch.Generator().manual_seed(num_tokens * 31 + num_q_heads + head_dim)
    if fused:  # q and k as strided views of a fused qkv projection, split as llama.py does
        q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
        qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=generator).to(device, dtype)
        q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, num_q_heads, head_dim)
        k = k.view(-1, num_kv_heads, head_dim)
    else:
        q = torch.randn(num_tokens, num_q_heads, head_dim, generator=generator).to(device, dtype)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(device, dtype)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=generator).to(device)
    scaling = {  # Llama-3.2's
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rotary = RotaryEmbedding(head_dim, MAX_POSITION, 500000.0, scaling).to(device)
    return positions, q, k, rotary.cos, rotary.sin


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize(
    "num_tokens, num_q_heads, num_kv_heads, head_dim, fused",
    [
        (1, 4, 4, 64, False),
        (7, 32, 8, 64, True),  # Llama-3.2-1B, GQA
        (7, 14, 2, 80, True),  # head_dim / 2 not a power of 2
        (300, 8, 2, 128, True),
        (300, 3, 1, 64, False),
    ],
)
def test_apply_rotary_matches_reference(
    num_tokens, num_q_heads, num_kv_heads, head_dim, fused, dtype, device
):
    positions, q, k, cos, sin = _make_inputs(
        num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, fused
    )
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = apply_rotary(positions, q, k, cos, sin)
    q_expected, k_expected = apply_rotary_reference(positions, q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == dtype
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(q_out, q_expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(k_out, k_expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(q, q_before, rtol=0, atol=0)
    torch.testing.assert_close(k, k_before, rtol=0, atol=0)


def test_apply_rotary_int32_positions_and_low_precision_cache():
    positions, q, k, cos, sin = _make_inputs(5, 4, 2, 64, torch.float16, DEVICE, fused=True)
    cos, sin = cos.half(), sin.half()  # as after `model.to(torch.float16)`
    q_out, k_out = apply_rotary(positions.int(), q, k, cos, sin)
    q_expected, k_expected = apply_rotary_reference(positions, q, k, cos, sin)
    tolerance = TOLERANCE[torch.float16]
    torch.testing.assert_close(q_out, q_expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(k_out, k_expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens, num_q_heads, num_kv_heads, head_dim",
    [(1, 9, 3, 64), (7, 14, 2, 80), (300, 8, 2, 128)],
)
def test_rotate_rows_equals_reference(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype):
    """The CPU engine's form (rows once per step, q | k in one pass) gives the reference's
    exact bytes."""
    from atom.kernels.rotary import rotary_rows, rotate_rows

    positions, q, k, cos, sin = _make_inputs(
        num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, "cpu", fused=True
    )
    expected_q, expected_k = apply_rotary_reference(positions, q, k, cos, sin)
    rows = rotary_rows(positions, cos, sin, dtype)
    qk = q.as_strided(
        (num_tokens, num_q_heads + num_kv_heads, head_dim), (q.stride(0), head_dim, 1)
    )
    out_q, out_k = rotate_rows(qk, *rows).split([num_q_heads, num_kv_heads], dim=1)
    assert torch.equal(out_q, expected_q)
    assert torch.equal(out_k, expected_k)


@pytest.mark.parametrize("dtype,device", DTYPES)
def test_apply_rotary_in_place_on_a_partial_slice(dtype, device):
    """``out=(q, k)`` on the first rotary_dim channels of each head (Qwen3-Next's partial
    rotary): the slice rotated as the reference rotates it, the rest of each head untouched."""
    generator = torch.Generator().manual_seed(5)
    head_dim, rotary_dim = 32, 8
    q = torch.randn(3, 4, head_dim, generator=generator).to(device, dtype)
    k = torch.randn(3, 2, head_dim, generator=generator).to(device, dtype)
    positions = torch.tensor([0, 7, 100], device=device)
    angles = torch.randn(128, rotary_dim // 2, generator=generator)
    cos = torch.cat([angles, angles], -1).cos().to(device)
    sin = torch.cat([angles, angles], -1).sin().to(device)
    q_ref, k_ref = apply_rotary_reference(
        positions, q[..., :rotary_dim], k[..., :rotary_dim], cos, sin
    )
    q_rest, k_rest = q[..., rotary_dim:].clone(), k[..., rotary_dim:].clone()
    q_rot, k_rot = q[..., :rotary_dim], k[..., :rotary_dim]
    apply_rotary(positions, q_rot, k_rot, cos, sin, out=(q_rot, k_rot))
    atol = TOLERANCE[dtype]
    torch.testing.assert_close(q[..., :rotary_dim], q_ref, rtol=0, atol=atol)
    torch.testing.assert_close(k[..., :rotary_dim], k_ref, rtol=0, atol=atol)
    assert torch.equal(q[..., rotary_dim:], q_rest) and torch.equal(k[..., rotary_dim:], k_rest)

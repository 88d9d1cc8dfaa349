"""rotary_kv_write (RoPE + KV-cache write in one kernel) against the two kernels it replaces
(bit for bit) and against its torch reference, plain and fp8 caches."""

import pytest
import torch

from atom.kernels import apply_rotary, store_kvcache
from atom.kernels.kv_cache import FP8_DTYPE, dequantize_fp8_reference
from atom.kernels.rotary_kv import rotary_kv_write, rotary_kv_write_reference
from atom.models.layers import RotaryEmbedding

# fp32 and fp16 run the kernel on CUDA when there is one, else under TRITON_INTERPRET=1
# (conftest); bf16 only on CUDA (the interpreter rounds float -> bf16 toward zero).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    (torch.float32, DEVICE),
    (torch.float16, DEVICE),
    pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu),
]
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2.0**-7, torch.bfloat16: 2.0**-4}
MAX_POSITION = 2048
BLOCK_SIZE = 16


def _inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, kv_cache_dtype):
    generator = torch.Generator().manual_seed(num_tokens * 7 + head_dim)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    # q, k, v as strided views of one fused qkv output, split as llama.py does
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=generator).to(device, dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(-1, num_q_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.view(-1, num_kv_heads, head_dim)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=generator).to(device)
    num_blocks = num_tokens // BLOCK_SIZE + 3
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=generator)[:num_tokens]
    slots[torch.rand(num_tokens, generator=generator) < 0.2] = -1  # padding tokens
    rotary = RotaryEmbedding(head_dim, MAX_POSITION, 500000.0, None).to(device)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)

    def caches():  # two identical sets of garbage-filled caches
        g = torch.Generator().manual_seed(5)
        if kv_cache_dtype == "fp8":
            k_cache = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)
            v_cache = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)
            scales = dict(
                k_scale=torch.randn(shape[:3], generator=g).to(device),
                v_scale=torch.randn(shape[:3], generator=g).to(device),
            )
            return k_cache.view(FP8_DTYPE), v_cache.view(FP8_DTYPE), scales
        k_cache = torch.randn(shape, generator=g).to(device, dtype)
        return k_cache, torch.randn(shape, generator=g).to(device, dtype), {}

    return (positions, q, k, v, rotary.cos, rotary.sin), slots.to(device), caches


def _same_bytes(got, expected):
    return torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize(
    "num_tokens, num_q_heads, num_kv_heads, head_dim",
    [
        (1, 32, 8, 64),
        (37, 14, 2, 80),  # head_dim / 2 not a power of 2
        pytest.param(300, 8, 2, 128, marks=pytest.mark.gpu),  # slow in the interpreter
    ],
)
def test_rotary_kv_write_equals_rotary_then_store(
    num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, kv_cache_dtype
):
    if kv_cache_dtype == "fp8" and dtype == torch.float16:
        pytest.skip("fp8 covered in fp32 (CPU) and bf16 (GPU)")
    if kv_cache_dtype == "fp8" and device == "cuda":
        pytest.xfail(
            "H200 2026-12-01: the fused e4m3 bytes differ from store_kvcache's; the engine "
            "keeps rotary + store for fp8 caches (atom/attention/mha.py)"
        )
    rope, slots, caches = _inputs(
        num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, kv_cache_dtype
    )
    positions, q, k, v, cos, sin = rope
    q_before, k_before = q.clone(), k.clone()
    k_cache, v_cache, scales = caches()
    q_out = rotary_kv_write(*rope, k_cache, v_cache, slots, **scales)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # inputs untouched

    k_cache2, v_cache2, scales2 = caches()
    q_rot, k_rot = apply_rotary(positions, q, k, cos, sin)
    store_kvcache(k_rot, v, k_cache2, v_cache2, slots, **scales2)
    assert q_out.is_contiguous() and _same_bytes(q_out, q_rot)
    assert _same_bytes(k_cache, k_cache2) and _same_bytes(v_cache, v_cache2)
    for name in scales:
        assert _same_bytes(scales[name], scales2[name]), name

    # and the torch reference, within rotary's tolerance (fp8: dequantized rows)
    k_cache3, v_cache3, scales3 = caches()
    q_expected = rotary_kv_write_reference(*rope, k_cache3, v_cache3, slots, **scales3)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(q_out, q_expected, rtol=tolerance, atol=tolerance)
    written = slots[slots >= 0].long()
    for got, expected, name in ((k_cache, k_cache3, "k_scale"), (v_cache, v_cache3, "v_scale")):
        if kv_cache_dtype == "fp8":
            got = dequantize_fp8_reference(
                got.flatten(0, 1)[written], scales[name].flatten(0, 1)[written]
            )
            expected = dequantize_fp8_reference(
                expected.flatten(0, 1)[written], scales3[name].flatten(0, 1)[written]
            )
            torch.testing.assert_close(got, expected, rtol=0.07, atol=1e-3)
        else:
            torch.testing.assert_close(
                got.flatten(0, 1)[written],
                expected.flatten(0, 1)[written],
                rtol=tolerance,
                atol=tolerance,
            )
    # slots nobody wrote keep their garbage
    untouched = torch.ones(k_cache.shape[0] * BLOCK_SIZE, dtype=torch.bool, device=device)
    untouched[written] = False
    assert _same_bytes(k_cache.flatten(0, 1)[untouched], k_cache3.flatten(0, 1)[untouched])

"""store_kvcache: the Triton kernel against its torch reference, and the reference itself."""

import pytest
import torch

from atom.kernels import store_kvcache, store_kvcache_reference

# fp32 runs the kernel on CUDA when there is one, else under TRITON_INTERPRET=1 (conftest).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    (torch.float32, DEVICE),
    pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu),
    pytest.param(torch.float16, "cuda", marks=pytest.mark.gpu),
]


def _make_inputs(num_tokens, num_kv_heads, head_dim, block_size, dtype, device, fused, index_dtype):
    generator = torch.Generator().manual_seed(num_tokens)
    num_blocks = (num_tokens + block_size - 1) // block_size + 2
    if fused:  # key/value as strided views of a fused qkv projection
        qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=generator)
        qkv = qkv.to(device, dtype)
        key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    else:
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(device, dtype)
        value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(
            device, dtype
        )
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[torch.rand(num_tokens, generator=generator) < 0.2] = -1  # padding tokens
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=generator).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=generator).to(device, dtype)
    return key, value, k_cache, v_cache, slots.to(device, index_dtype)


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize(
    "num_tokens, num_kv_heads, head_dim, block_size, fused, index_dtype",
    [
        (1, 1, 64, 16, False, torch.int32),
        (37, 2, 64, 16, True, torch.int64),
        (1500, 8, 128, 32, True, torch.int32),
        (200, 4, 80, 16, False, torch.int64),  # head_dim not a power of 2
    ],
)
def test_store_kvcache_matches_reference(
    num_tokens, num_kv_heads, head_dim, block_size, fused, index_dtype, dtype, device
):
    key, value, k_cache, v_cache, slots = _make_inputs(
        num_tokens, num_kv_heads, head_dim, block_size, dtype, device, fused, index_dtype
    )
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    store_kvcache_reference(key, value, k_expected, v_expected, slots)
    store_kvcache(key, value, k_cache, v_cache, slots)
    # A copy: bit-exact, untouched slots included.
    torch.testing.assert_close(k_cache, k_expected, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_expected, rtol=0, atol=0)


def test_store_kvcache_reference_writes_slots_and_skips_padding():
    num_blocks, block_size, num_kv_heads, head_dim = 3, 4, 2, 8
    key = torch.randn(3, num_kv_heads, head_dim)
    value = torch.randn(3, num_kv_heads, head_dim)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, -1, 11])  # block 1 offset 1, padding, block 2 offset 3
    store_kvcache_reference(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(v_cache[2, 3], value[2])
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    written[1, 1] = written[2, 3] = True
    assert k_cache[~written].abs().sum() == 0 and v_cache[~written].abs().sum() == 0

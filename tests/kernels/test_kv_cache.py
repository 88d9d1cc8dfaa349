"""store_kvcache: the Triton kernel against its torch reference, and the reference itself,
plain and fp8-quantized (every byte of the cache and of the scales compared)."""

import pytest
import torch

from atom.kernels import store_kvcache, store_kvcache_reference
from atom.kernels.kv_cache import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8_reference,
    quantize_fp8_reference,
)

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
        # Rows of very different magnitudes (fp8 scales per row), one all-zero token.
        qkv *= torch.logspace(-4, 4, num_tokens)[torch.randperm(num_tokens, generator=generator)][
            :, None, None
        ]
        qkv[num_tokens // 2] = 0.0
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


def _fp8_caches(k_cache, generator_seed=0):
    """fp8 caches of k_cache's shape full of random bytes, and scales full of garbage."""
    generator = torch.Generator().manual_seed(generator_seed)
    shape, device = k_cache.shape, k_cache.device
    caches = [
        torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator).to(device)
        for _ in range(2)
    ]
    scales = [torch.randn(shape[:3], generator=generator).to(device) for _ in range(2)]
    return caches[0].view(FP8_DTYPE), caches[1].view(FP8_DTYPE), scales[0], scales[1]


def _assert_same_bytes(got: torch.Tensor, expected: torch.Tensor, name: str):
    got, expected = got.view(torch.uint8), expected.view(torch.uint8)
    if not torch.equal(got, expected):
        wrong = (got != expected).nonzero()
        raise AssertionError(f"{name}: {len(wrong)} bytes differ, first at {wrong[:4].tolist()}")


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


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize(
    "num_tokens, num_kv_heads, head_dim, block_size, fused, index_dtype",
    [
        (1, 1, 64, 16, False, torch.int32),
        (37, 2, 64, 16, True, torch.int64),
        (300, 12, 128, 16, True, torch.int32),  # 32-row programs cut tokens in the middle
        (200, 4, 80, 16, True, torch.int64),  # head_dim not a power of 2
    ],
)
def test_store_kvcache_fp8_matches_reference_bytes(
    num_tokens, num_kv_heads, head_dim, block_size, fused, index_dtype, dtype, device
):
    key, value, k_cache, _, slots = _make_inputs(
        num_tokens, num_kv_heads, head_dim, block_size, dtype, device, fused, index_dtype
    )
    k_fp8, v_fp8, k_scale, v_scale = _fp8_caches(k_cache)
    expected = [t.clone() for t in (k_fp8, v_fp8, k_scale, v_scale)]
    store_kvcache_reference(
        key, value, expected[0], expected[1], slots, k_scale=expected[2], v_scale=expected[3]
    )
    store_kvcache(key, value, k_fp8, v_fp8, slots, k_scale=k_scale, v_scale=v_scale)
    names = ("k_cache", "v_cache", "k_scale", "v_scale")
    for got, want, name in zip((k_fp8, v_fp8, k_scale, v_scale), expected, names, strict=True):
        _assert_same_bytes(got, want, name)


def test_fp8_quantization_error_is_bounded_per_row():
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(4096, 128, generator=generator)
    rows *= torch.logspace(-6, 6, 4096)[:, None]  # scales from 1e-6 to 1e6
    rows[7] = 0.0
    rows[9, 5] = -1e-30  # a single tiny value
    quantized, scale = quantize_fp8_reference(rows)
    assert quantized.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert not torch.isnan(quantized.float()).any()
    restored = dequantize_fp8_reference(quantized, scale)
    amax = rows.abs().amax(dim=-1)
    # e4m3 keeps 3 mantissa bits: the top binade [256, 448] has spacing 32, so no element
    # is off by more than 16 / 448 of its row's maximum; the maximum itself is exact.
    error = (restored - rows).abs().amax(dim=-1)
    assert (error <= amax * (16 / FP8_MAX) * (1 + 1e-6)).all()
    top = rows.abs().argmax(dim=-1, keepdim=True)
    torch.testing.assert_close(restored.gather(1, top), rows.gather(1, top), rtol=1e-6, atol=0)
    assert torch.equal(restored[7], torch.zeros(128)) and torch.isfinite(scale).all()
    assert restored[9].abs().max() > 0  # a lone tiny value keeps its own scale


def test_store_kvcache_reference_fp8_writes_slots_and_skips_padding():
    num_blocks, block_size, num_kv_heads, head_dim = 3, 4, 2, 8
    key = torch.randn(3, num_kv_heads, head_dim)
    value = torch.randn(3, num_kv_heads, head_dim)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(num_blocks, block_size, num_kv_heads)
    v_scale = torch.zeros_like(k_scale)
    slots = torch.tensor([5, -1, 11])
    store_kvcache_reference(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    restored = dequantize_fp8_reference(k_cache[1, 1], k_scale[1, 1])
    torch.testing.assert_close(restored, key[0], rtol=0.07, atol=0)
    restored = dequantize_fp8_reference(v_cache[2, 3], v_scale[2, 3])
    torch.testing.assert_close(restored, value[2], rtol=0.07, atol=0)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    written[1, 1] = written[2, 3] = True
    assert k_scale[~written].abs().sum() == 0 and v_cache[~written].float().abs().sum() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "auto"])
def test_store_kvcache_past_2_31_elements_on_gpu(kv_cache_dtype):
    """A million tokens x 12 heads x 128 into caches of 1.5M slots (2.4e9 elements each):
    offsets past 2^31 must be int64. Every byte of the caches and scales is compared with
    the reference (computed on the GPU in chunks of 64K tokens)."""
    num_tokens, num_kv_heads, head_dim, block_size = 1 << 20, 12, 128, 16
    num_slots = 3 << 19  # 1,572,864
    assert num_slots * num_kv_heads * head_dim > 2**31
    device, dtype = "cuda", torch.bfloat16
    generator = torch.Generator(device).manual_seed(0)
    shape = (num_tokens, num_kv_heads, head_dim)
    key = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    value = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    # Rows of very different magnitudes, so scales differ.
    key *= torch.exp(2 * torch.randn(*shape[:2], 1, device=device, generator=generator)).to(dtype)
    value *= torch.exp(2 * torch.randn(*shape[:2], 1, device=device, generator=generator)).to(dtype)
    slots = torch.randperm(num_slots, device=device, generator=generator)[:num_tokens]
    # token 0 goes to the very last row of the cache (and no other token does)
    taken = torch.nonzero(slots == num_slots - 1).flatten()
    if taken.numel():
        slots[taken] = slots[0].clone()
    slots[0] = num_slots - 1
    slots[1::97] = -1  # padding tokens
    num_blocks = num_slots // block_size
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if kv_cache_dtype == "fp8":
        k_cache = torch.full(cache_shape, 0x5A, dtype=torch.uint8, device=device).view(FP8_DTYPE)
        scales = dict(
            k_scale=torch.full(cache_shape[:3], -1.0, device=device),
            v_scale=torch.full(cache_shape[:3], -2.0, device=device),
        )
    else:
        k_cache = torch.full(cache_shape, -3.0, dtype=dtype, device=device)
        scales = {}
    v_cache = k_cache.clone()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_scales = {name: t.clone() for name, t in scales.items()}

    store_kvcache(key, value, k_cache, v_cache, slots, **scales)
    chunk = 1 << 16
    for start in range(0, num_tokens, chunk):
        part = slice(start, start + chunk)
        store_kvcache_reference(
            key[part], value[part], expected_k, expected_v, slots[part], **expected_scales
        )
    torch.cuda.synchronize()
    _assert_same_bytes(k_cache, expected_k, "k_cache")
    _assert_same_bytes(v_cache, expected_v, "v_cache")
    for name, got in scales.items():
        _assert_same_bytes(got, expected_scales[name], name)
    # The very last row holds token 0's key (the comparison above would also pass if the
    # kernel and the reference wrote nothing at all).
    last = k_cache.view(-1, num_kv_heads, head_dim)[num_slots - 1]
    if kv_cache_dtype == "fp8":
        last = dequantize_fp8_reference(last, scales["k_scale"].view(-1, num_kv_heads)[-1])
    error = (last.float() - key[0].float()).abs()
    bound = key[0].float().abs().amax(dim=-1, keepdim=True) * (16 / FP8_MAX) * (1 + 1e-5)
    assert (error <= bound).all()


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


@pytest.mark.parametrize("slots", [[5, 0, 11], [5, -1, 11], [-1, -1, 2]])
def test_store_kvcache_cpu_equals_reference(slots):
    """The CPU engine's planned write (one index_copy_ per cache) writes the reference's
    bytes, padding rows skipped; key / value may be strided views of a wider tensor."""
    from atom.kernels.kv_cache import kv_write_plan, store_kvcache_cpu

    num_blocks, block_size, num_kv_heads, head_dim = 3, 4, 2, 8
    qkv = torch.randn(len(slots), 5, num_kv_heads, head_dim)
    key, value = qkv[:, 1], qkv[:, 3]
    slots = torch.tensor(slots)
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim) for _ in range(2)]
    expected = [c.clone() for c in caches]
    store_kvcache_reference(key, value, *expected, slots)
    store_kvcache_cpu(key, value, *caches, kv_write_plan(slots))
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])

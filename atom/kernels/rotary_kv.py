"""The attention prologue in one launch: RoPE of q and k, and the KV-cache write.

Replaces ``apply_rotary`` followed by ``store_kvcache`` (two kernels per layer and step)
with one kernel that reads q, k and v in place from the fused QKV projection's output.

Shapes and dtypes:
    positions      [num_tokens], int32 or int64.
    q              [num_tokens, num_q_heads, head_dim]; k, v [num_tokens, num_kv_heads,
                   head_dim]; fp32/bf16/fp16, one dtype; strided views (slices of the fused
                   qkv output) are fine, only head_dim must be unit-stride.
    cos_cache,
    sin_cache      [max_position, head_dim] (both halves, as ``RotaryEmbedding`` builds them).
    k_cache,
    v_cache        [num_blocks, block_size, num_kv_heads, head_dim] contiguous: q's dtype, or
                   torch.float8_e4m3fn with k_scale / v_scale [num_blocks, block_size,
                   num_kv_heads] float32 (atom/kernels/kv_cache.py for the format).
    slot_mapping   [num_tokens], int32 or int64; -1 = padding token: nothing is written to
                   the cache (its q is still rotated).
    returns        q_out [num_tokens, num_q_heads, head_dim], contiguous, q's dtype.

Numerics: exactly those of the two kernels it replaces. The rotation is the rotary kernel's
(fp32, rounded once to q's dtype; see atom/kernels/rotary.py), the rotated k is rounded to
its dtype before it is stored or quantized, as ``store_kvcache`` receives it; fp8 rows are
quantized with the store kernel's amax / 448 scale and IEEE divisions. So the cache bytes
and q_out equal ``apply_rotary`` + ``store_kvcache`` bit for bit (up to the compiler's FMA
contraction on a GPU), and ``rotary_kv_write_reference`` within rotary's tolerance.

Kernel design: one program per token; it loads the token's cos/sin row once and handles
every q and kv head as [heads, head_dim / 2] half tiles. Row amax for fp8 is the larger of
the two halves' maxima.

Runtime lengths (never constexpr, in do_not_specialize): num_tokens. Geometry (constexpr):
heads, head_dim, tiles, whether the cache is fp8. Offsets are int64.
"""

import torch

from atom.kernels.kv_cache import _check_cache, _e4m3_bits, store_kvcache_reference
from atom.kernels.platform import use_triton
from atom.kernels.rotary import apply_rotary_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


@triton.jit
def _write_halves(
    first,
    second,
    cache_ptr,
    scale_ptr,
    cache_row,
    offs_dim,
    mask,
    row_mask,
    HALF: tl.constexpr,
    QUANTIZE: tl.constexpr,
    SOFTWARE_FP8: tl.constexpr,
):
    """Store [heads, BLOCK_HALF] first and second halves of cache rows (already in the input
    dtype) at cache_row * 2 * HALF, plain or quantized to e4m3 with one scale per row."""
    ptrs = cache_ptr + cache_row[:, None] * (2 * HALF) + offs_dim
    if QUANTIZE:
        x1 = first.to(tl.float32)
        x2 = second.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1))
        amax = tl.maximum(amax, 7.888609052210118e-31)  # MIN_AMAX = 2^-100
        fp8_max = tl.full(amax.shape, 448.0, tl.float32)  # FP8_MAX
        inverse = tl.math.div_rn(fp8_max, amax)
        scale = tl.math.div_rn(amax, fp8_max)
        y1 = tl.minimum(tl.maximum(x1 * inverse[:, None], -448.0), 448.0)
        y2 = tl.minimum(tl.maximum(x2 * inverse[:, None], -448.0), 448.0)
        if SOFTWARE_FP8:
            tl.store(ptrs, _e4m3_bits(y1), mask=mask)
            tl.store(ptrs + HALF, _e4m3_bits(y2), mask=mask)
        else:
            tl.store(ptrs, y1.to(cache_ptr.dtype.element_ty), mask=mask)
            tl.store(ptrs + HALF, y2.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + cache_row, scale, mask=row_mask)
    else:
        tl.store(ptrs, first, mask=mask)
        tl.store(ptrs + HALF, second, mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _rotary_kv_write_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # float32 [slots, NUM_KV_HEADS], used when QUANTIZE
    v_scale_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_position,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    QUANTIZE: tl.constexpr,
    SOFTWARE_FP8: tl.constexpr,  # the interpreter: cast to e4m3 with integer arithmetic
):
    token = tl.program_id(0).to(tl.int64)  # the grid is exactly num_tokens
    dtype = q_ptr.dtype.element_ty
    position = tl.load(positions_ptr + token).to(tl.int64)
    offs_dim = tl.arange(0, BLOCK_HALF)[None, :]
    dim_mask = offs_dim < HALF
    cache = position * stride_cache_position + offs_dim
    # Rounded to q's dtype first, as the rotary kernel and its torch reference do.
    cos_first = tl.load(cos_ptr + cache, mask=dim_mask, other=0.0).to(dtype).to(tl.float32)
    sin_first = tl.load(sin_ptr + cache, mask=dim_mask, other=0.0).to(dtype).to(tl.float32)
    cos_second = tl.load(cos_ptr + cache + HALF, mask=dim_mask, other=0.0)
    cos_second = cos_second.to(dtype).to(tl.float32)
    sin_second = tl.load(sin_ptr + cache + HALF, mask=dim_mask, other=0.0)
    sin_second = sin_second.to(dtype).to(tl.float32)

    # q: rotate every head into q_out (contiguous [tokens, NUM_Q_HEADS, 2 * HALF]).
    offs_q = tl.arange(0, BLOCK_Q_HEADS)[:, None]
    q_mask = (offs_q < NUM_Q_HEADS) & dim_mask
    src = q_ptr + token * stride_q_token + offs_q * stride_q_head + offs_dim
    x1 = tl.load(src, mask=q_mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=q_mask, other=0.0).to(tl.float32)
    dst = q_out_ptr + (token * NUM_Q_HEADS + offs_q) * (2 * HALF) + offs_dim
    tl.store(dst, (x1 * cos_first - x2 * sin_first).to(dtype), mask=q_mask)
    tl.store(dst + HALF, (x2 * cos_second + x1 * sin_second).to(dtype), mask=q_mask)

    # k (rotated) and v into the cache at the token's slot; padding tokens write nothing.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs_kv = tl.arange(0, BLOCK_KV_HEADS)
    row_mask = (offs_kv < NUM_KV_HEADS) & (slot + offs_kv * 0 >= 0)  # a vector, not a scalar
    kv_mask = row_mask[:, None] & dim_mask
    cache_row = slot * NUM_KV_HEADS + offs_kv
    src = k_ptr + token * stride_k_token + offs_kv[:, None] * stride_k_head + offs_dim
    x1 = tl.load(src, mask=kv_mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    k_first = (x1 * cos_first - x2 * sin_first).to(dtype)
    k_second = (x2 * cos_second + x1 * sin_second).to(dtype)
    src = v_ptr + token * stride_v_token + offs_kv[:, None] * stride_v_head + offs_dim
    v_first = tl.load(src, mask=kv_mask, other=0.0)
    v_second = tl.load(src + HALF, mask=kv_mask, other=0.0)
    _write_halves(
        k_first, k_second, k_cache_ptr, k_scale_ptr, cache_row, offs_dim, kv_mask, row_mask,
        HALF, QUANTIZE, SOFTWARE_FP8,
    )  # fmt: skip
    _write_halves(
        v_first, v_second, v_cache_ptr, v_scale_ptr, cache_row, offs_dim, kv_mask, row_mask,
        HALF, QUANTIZE, SOFTWARE_FP8,
    )  # fmt: skip


def rotary_kv_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k, write rotated k and v at ``slot_mapping``; returns the rotated q.

    The caches (and with fp8 the scales) are written in place; q, k, v are not modified.
    Runs the Triton kernel on CUDA (or under TRITON_INTERPRET=1), the reference otherwise.
    """
    if not use_triton(q):
        return rotary_kv_write_reference(
            positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and k.dtype == q.dtype
    assert positions.shape == (num_tokens,) and slot_mapping.shape[0] >= num_tokens
    assert head_dim % 2 == 0, "rotate_half needs an even head_dim"
    assert q.stride(2) == 1, "head_dim must be unit-stride"
    assert cos_cache.shape[1] == head_dim and sin_cache.shape == cos_cache.shape
    assert cos_cache.stride(1) == 1 and sin_cache.stride() == cos_cache.stride()
    quantize = _check_cache(k, v, k_cache, v_cache, k_scale, v_scale)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    software_fp8 = quantize and not q.is_cuda
    if software_fp8:  # the interpreter writes e4m3 bit patterns (see kv_cache._e4m3_bits)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if not quantize:  # never read
        k_scale = v_scale = cos_cache
    half = head_dim // 2
    _rotary_kv_write_kernel[(num_tokens,)](
        positions,
        q,
        k,
        v,
        cos_cache,
        sin_cache,
        q_out,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        slot_mapping,
        num_tokens,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        QUANTIZE=quantize,
        SOFTWARE_FP8=software_fp8,
        num_warps=4,
    )
    return q_out


def rotary_kv_write_reference(
    positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, *,
    k_scale=None, v_scale=None,
) -> torch.Tensor:  # fmt: skip
    """Pure-torch ``rotary_kv_write``: ``apply_rotary_reference`` then
    ``store_kvcache_reference`` of the rotated k and of v."""
    q_out, k_out = apply_rotary_reference(positions, q, k, cos_cache, sin_cache)
    store_kvcache_reference(
        k_out, v, k_cache, v_cache, slot_mapping[: q.shape[0]], k_scale=k_scale, v_scale=v_scale
    )
    return q_out.contiguous()

"""Writing this step's keys and values into the paged KV cache, optionally quantized to fp8.

Shapes and dtypes:
    key, value     [num_tokens, num_kv_heads, head_dim], fp32/bf16/fp16; may be strided views
                   (e.g. slices of a fused qkv projection), only head_dim must be unit-stride.
    k_cache,
    v_cache        [num_blocks, block_size, num_kv_heads, head_dim], contiguous; key's dtype
                   (a plain copy) or torch.float8_e4m3fn (quantized, see below).
    k_scale,
    v_scale        [num_blocks, block_size, num_kv_heads] float32, contiguous; only with an
                   fp8 cache: element (block, offset, head) dequantizes that cache row.
    slot_mapping   [num_tokens], int32 or int64; slot = block_id * block_size + offset in block,
                   slot == -1 means "padding token, write nothing".

Runtime lengths (never constexpr, in do_not_specialize): num_tokens. Geometry (constexpr):
heads, head_dim, tile sizes, whether to quantize. Offsets are int64: a cache of a million
slots x 12 heads x 128 dims passes 2^31 elements.

fp8 KV cache (``Config.kv_cache_dtype="fp8"``): e4m3 (``torch.float8_e4m3fn``, largest
finite 448) with one float32 scale per token and kv head (per (slot, head) row of head_dim
values). Why per-token-per-head rather than one scale per tensor:
  - no calibration: the scale is computed from the row being written (amax / 448), so
    checkpoints without KV scales and any prompt distribution work as they are;
  - outliers stay local: a token or head with large activations (attention sinks, massive
    activations in a few channels) coarsens only its own 128 values, not the whole cache;
  - cost: 4 bytes per head-token beside head_dim bytes (3% at head_dim 128), and one extra
    scalar load per K/V row in the attention kernels.
The scale is amax / 448 (amax: the row's largest magnitude), so the row maximum lands on
e4m3's largest value. Quantize = round-to-nearest-even of min(max(x * (448 / amax), -448), 448),
dequantize = q * scale. The two divisions are once per row and IEEE-rounded on both sides
(``tl.math.div_rn`` in the kernel; tensor-by-tensor division in torch, which CUDA and CPU
round correctly), so the kernel and ``store_kvcache_reference`` agree bit for bit on every
device. (A power-of-two scale would make everything exact without IEEE division, but leaves
the row maximum anywhere in (224, 448]: on random rows 3% more RMS error when Gaussian, 1.9x
when two outlier channels dominate.) amax is clamped to 2^-100, so an all-zero row gets
zeros and a tiny scale. Under TRITON_INTERPRET the cast to e4m3 is done in integer
arithmetic (``_e4m3_bits``): the interpreter's own cast drops carries.

Kernel design: the input is viewed as num_tokens * num_kv_heads rows of head_dim values. A
program takes BLOCK_R whole rows (about 4K elements: 32 rows at head_dim 128, so 4,096
tokens x 12 heads make 1,536 programs), loads its K and V tiles first (16-byte vectors: the
row starts are multiples of 16 elements whenever the specialized strides are, and head_dim
is contiguous), reduces each row's amax in registers, and writes the fp8 rows (contiguous
head_dim bytes at (slot * heads + head) * head_dim) and the scales.
"""

import torch

from atom.kernels.platform import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value: 1.75 * 2^8 (written out in the kernels)
MIN_AMAX = 2.0**-100  # exact in fp32; 448 / MIN_AMAX stays finite


def is_quantized(cache: torch.Tensor) -> bool:
    """True for an fp8 KV cache (which then comes with per-row scales)."""
    return cache.dtype == FP8_DTYPE


@triton.jit
def _e4m3_bits(y):
    """fp32 values with |y| <= 448 -> e4m3fn bit patterns (uint8), round to nearest even.

    Used under TRITON_INTERPRET only: the interpreter's own fp32 -> fp8 cast drops the carry
    when rounding up crosses a power of two (31.6 -> 16 instead of 32). On a GPU the
    hardware cast (cvt.rn.satfinite) is exact and 16 times cheaper.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # Normal e4m3 (|y| >= 2^-6): round the 23-bit mantissa to 3 bits (a carry moves into
    # the exponent field, as it should), then rebias the exponent from 127 to 7.
    rounded = magnitude + 0x7FFFF + ((magnitude >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal e4m3: code = round(|y| * 2^9) in 0..8 (8 is the smallest normal, 2^-6).
    absolute = magnitude.to(tl.float32, bitcast=True)
    subnormal = ((absolute * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(magnitude < (121 << 23), subnormal, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _quantize_rows(x, cache_ptrs, scale_ptrs, mask, row_mask, SOFTWARE_FP8: tl.constexpr):
    """Quantize a [rows, BLOCK_D] fp32 tile to e4m3 with one scale (amax / 448) per row."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 7.888609052210118e-31)  # MIN_AMAX = 2^-100
    fp8_max = tl.full(amax.shape, 448.0, tl.float32)  # FP8_MAX
    inverse = tl.math.div_rn(fp8_max, amax)
    scale = tl.math.div_rn(amax, fp8_max)
    y = tl.minimum(tl.maximum(x * inverse[:, None], -448.0), 448.0)
    if SOFTWARE_FP8:
        tl.store(cache_ptrs, _e4m3_bits(y), mask=mask)
    else:
        tl.store(cache_ptrs, y.to(cache_ptrs.dtype.element_ty), mask=mask)
    tl.store(scale_ptrs, scale, mask=row_mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # float32 [slots, NUM_KV_HEADS], used when QUANTIZE
    v_scale_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,  # (token, head) rows per program
    BLOCK_D: tl.constexpr,  # next_power_of_2(HEAD_DIM)
    QUANTIZE: tl.constexpr,  # fp8 cache + scales; else a plain copy
    SOFTWARE_FP8: tl.constexpr,  # the interpreter: cast to e4m3 with integer arithmetic
):
    # Row r of the input is (token r // NUM_KV_HEADS, head r % NUM_KV_HEADS). Row numbers fit
    # int32 (num_tokens * heads < 2^31); every element offset is int64.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    token = rows // NUM_KV_HEADS
    head = rows % NUM_KV_HEADS
    offs_d = tl.arange(0, BLOCK_D)

    slot = tl.load(slot_mapping_ptr + token, mask=token < num_tokens, other=-1).to(tl.int64)
    row_mask = slot >= 0  # padding tokens (-1) and rows past the end write nothing
    mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]

    token = token.to(tl.int64)
    key_rows = key_ptr + token * stride_key_token + head * stride_key_head
    value_rows = value_ptr + token * stride_value_token + head * stride_value_head
    # Both tiles are loaded before anything is stored, so both are in flight at once.
    key = tl.load(key_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    value = tl.load(value_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)

    # The cache is contiguous: row (slot, head) starts at (slot * NUM_KV_HEADS + head) * HEAD_DIM.
    cache_row = slot * NUM_KV_HEADS + head
    cache_offs = cache_row[:, None] * HEAD_DIM + offs_d[None, :]
    if QUANTIZE:
        _quantize_rows(
            key.to(tl.float32),
            k_cache_ptr + cache_offs,
            k_scale_ptr + cache_row,
            mask,
            row_mask,
            SOFTWARE_FP8,
        )
        _quantize_rows(
            value.to(tl.float32),
            v_cache_ptr + cache_offs,
            v_scale_ptr + cache_row,
            mask,
            row_mask,
            SOFTWARE_FP8,
        )
    else:
        tl.store(k_cache_ptr + cache_offs, key, mask=mask)
        tl.store(v_cache_ptr + cache_offs, value, mask=mask)


def store_config(num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_R, num_warps) of the store kernel: geometry only, never the length."""
    block_r = max(1, 4096 // triton.next_power_of_2(head_dim))  # ~4K elements of K and of V
    return block_r, 4


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` rows into ``k_cache``/``v_cache`` at ``slot_mapping`` (in place).

    With an fp8 cache the rows are quantized and their scales written to ``k_scale`` /
    ``v_scale``. Tokens whose slot is -1 are skipped. Runs the Triton kernel on CUDA (or
    under TRITON_INTERPRET=1), the torch reference otherwise.
    """
    if not use_triton(key):
        store_kvcache_reference(
            key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
        )
        return
    _check_cache(key, value, k_cache, v_cache, k_scale, v_scale)
    block_r, num_warps = store_config(key.shape[1], key.shape[2])
    launch_store_kernel(
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, block_r, num_warps
    )


def launch_store_kernel(
    key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, block_r: int, num_warps: int
) -> None:
    """One launch of the store kernel with an explicit tile (the benchmark tunes it)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert num_tokens * num_kv_heads < 2**31, "row numbers are int32"
    quantize = is_quantized(k_cache)
    software_fp8 = quantize and not key.is_cuda
    if software_fp8:  # the interpreter writes e4m3 bit patterns (see _e4m3_bits)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if not quantize:  # never read
        k_scale = v_scale = slot_mapping
    grid = (triton.cdiv(num_tokens * num_kv_heads, block_r),)
    _store_kvcache_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_R=block_r,
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANTIZE=quantize,
        SOFTWARE_FP8=software_fp8,
        num_warps=num_warps,
    )


def _check_cache(key, value, k_cache, v_cache, k_scale, v_scale) -> bool:
    """Shape checks shared by the kernel path; returns whether the cache is fp8."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and value.dtype == key.dtype
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be unit-stride"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    if not is_quantized(k_cache):
        assert k_cache.dtype == key.dtype, "an unquantized cache has the dtype of key"
        return False
    assert k_scale is not None and v_scale is not None, "an fp8 cache needs k_scale and v_scale"
    for scale in (k_scale, v_scale):
        assert scale.shape == k_cache.shape[:3] and scale.dtype == torch.float32
        assert scale.is_contiguous()
    return True


def quantize_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., head_dim] -> (fp8 rows, float32 scales [...]), the kernel's exact math."""
    x = x.float()
    amax = x.abs().amax(dim=-1).clamp(min=MIN_AMAX)
    # Tensor / tensor: a Python-scalar divisor may become a multiply by its reciprocal.
    fp8_max = torch.full_like(amax, FP8_MAX)
    inverse, scale = fp8_max / amax, amax / fp8_max
    quantized = (x * inverse[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def dequantize_fp8_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 rows [..., head_dim] and their scales [...] -> float32 rows."""
    return q.float() * scale[..., None]


def kv_write_plan(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(rows, slots) of a step's cache write for `store_kvcache_cpu`, computed once per step:
    the int64 slots of the rows whose slot is not -1, and those rows (None: all of them)."""
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return None, slot_mapping.long()
    rows = valid.nonzero().squeeze(1)
    return rows, slot_mapping.index_select(0, rows).long()


def store_kvcache_cpu(key, value, k_cache, v_cache, plan) -> None:
    """``store_kvcache_reference`` of an unquantized cache with a `kv_write_plan`: one
    index_copy_ per cache (same bytes; the slots of a step are distinct)."""
    rows, slots = plan
    if rows is not None:
        key, value = key.index_select(0, rows), value.index_select(0, rows)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value)


def store_kvcache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Pure-torch ``store_kvcache``: same shapes, same in-place semantics, same fp8 bytes."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    # Contiguous caches flatten to [num_blocks * block_size, heads, dim] views.
    if not is_quantized(k_cache):
        k_cache.flatten(0, 1)[slots] = key[valid]
        v_cache.flatten(0, 1)[slots] = value[valid]
        return
    assert k_scale is not None and v_scale is not None, "an fp8 cache needs k_scale and v_scale"
    for rows, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        quantized, scale = quantize_fp8_reference(rows[valid])
        # Written through uint8 views: indexed copies of fp8 tensors are not on every device.
        cache.view(torch.uint8).flatten(0, 1)[slots] = quantized.view(torch.uint8)
        scales.flatten(0, 1)[slots] = scale

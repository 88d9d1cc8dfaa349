"""Linear layers with int4 weights (w4a16): a GEMV for decode, a GEMM for more rows.

y = x @ W^T (+ bias) with W[n, k] = (q[n, k] - zero[g, n]) * scale[g, n], g = k // group:
the one layout GPTQ, AWQ and compressed-tensors' pack-quantized are converted to at load
(atom/models/quantization/int4.py). ``words`` is int32 [K/8, N] packed along the inputs,
outputs contiguous (GPTQ's own ``qweight`` layout): input k of output n sits at bits
4 * (k % 8) of words[k // 8, n]. Scales and zero points are [G, N], outputs contiguous too.

Shapes and dtypes:
    x        [M, K] bf16/fp16/fp32, unit-stride columns (M: a runtime length), K % 8 == 0.
    words    int32 [K/8, N], unit-stride columns.
    scale    float32 [G, N]; zero uint8 [G, N] (8 for symmetric checkpoints), unit-stride
             columns, one row stride; G = ceil(K / group); group: a power of two >= 16, or
             >= K (one scale per output).
    out      [M, N], x's dtype.

Kernels:
- ``_int4_gemv_kernel`` (one row: batch-1 decode). Program (column block, K split) walks its
  word rows in [BLOCK_W, BLOCK_N] tiles: consecutive threads read consecutive outputs' words
  (16-byte loads), each thread sums its own outputs over K (no reduction across threads
  until the end), and x[8w + j] is the same for every thread of a row (a broadcast load).
  A nibble costs two instructions: an AND leaves it in place (bits 4j.., j < 4 of the word
  or of the word >> 16), and those bits, read as a float32, are the denormal
  q * 2^(4j - 149) (exact), so one FMA with x * 2^(85 - 4j) adds q * x * 2^-64; the 2^64
  comes back with the scale. Where a GPU flushed denormals (``_keeps_denormals``), the
  bits q * 16^j | 0x4B000000 are the float 2^23 + q * 16^j and one subtraction more gives
  it (``DENORMAL=False``). Zero points: s * (sum q x - z * sum x), per chunk of one group.
  K splits write float32 partial sums and ``_int4_split_sum_kernel`` adds them (no atomics:
  the same sum every run).
- ``_int4_dot_kernel`` (2 rows and more): the [BLOCK_K, BLOCK_N] weight tile dequantized to
  x's dtype (as the reference's dequantized weight), tl.dot with fp32 accumulation;
  BLOCK_K divides the group.

Runtime lengths: M (``num_rows``, in do_not_specialize). A layer's shape fixes K, N and the
GEMV's K split (``in_words``, ``out_features``, ``words_per_split``, ``splits``: plain
arguments). Geometry (constexpr): tiles, the group's words, bias or not, the nibble's form.
Word offsets are int64.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import torch.nn.functional as F

from atom.kernels.gemv_tiles import GemvConfig, tuned_quant_gemv
from atom.kernels.platform import dot_precision, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)

GEMV_MAX_ROWS = 16


@triton.jit
def _int4_gemv_kernel(
    x_ptr,  # [K], unit-stride
    words_ptr,  # int32 [K/8, N]
    scale_ptr,  # float32 [G, N]
    zero_ptr,  # uint8 [G, N]
    bias_ptr,  # [N] (HAS_BIAS and not SPLIT)
    out_ptr,  # [N], or float32 [splits, N] partial sums (SPLIT)
    in_words,  # K / 8
    out_features,
    words_per_split,  # word rows per program along K (a multiple of BLOCK_W)
    stride_words,  # of a word row
    stride_scale,  # of a scale / zero row
    HAS_BIAS: tl.constexpr,
    PER_ROW: tl.constexpr,  # one (scale, zero) per output
    GROUP_WORDS: tl.constexpr,  # word rows per group (PER_ROW: unused)
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,  # word rows per tile (a divisor or a multiple of GROUP_WORDS)
    SPLIT: tl.constexpr,  # write float32 partial sums at row program_id(1)
    DENORMAL: tl.constexpr,  # nibbles read as denormal floats (else as 2^23 + q)
    NUM_STAGES: tl.constexpr,
):
    """out[n] = sum_g scale[g, n] * (sum_{k in g} q[k, n] x[k] - zero[g, n] sum_{k in g} x[k])
    over this program's BLOCK_N outputs and its split of K."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    w_begin = tl.program_id(1) * words_per_split
    w_end = tl.minimum(w_begin + words_per_split, in_words)
    offs_w = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    x_total = tl.zeros([BLOCK_W], dtype=tl.float32)  # PER_ROW: sum of x over the split
    for w_start in tl.range(w_begin, w_end, BLOCK_W, num_stages=NUM_STAGES):
        rows = w_start + offs_w
        w_mask = rows < w_end
        packed = tl.load(
            words_ptr + rows.to(tl.int64)[:, None] * stride_words + offs_n[None, :],
            mask=w_mask[:, None] & n_mask[None, :], other=0, eviction_policy="evict_first",
        )  # fmt: skip
        high = packed >> 16
        x_row = x_ptr + rows.to(tl.int64) * 8
        dot = tl.zeros([BLOCK_W, BLOCK_N], dtype=tl.float32)
        x_sum = tl.zeros([BLOCK_W], dtype=tl.float32)
        for j in tl.static_range(4):
            x_lo = tl.load(x_row + j, mask=w_mask, other=0.0).to(tl.float32)
            x_hi = tl.load(x_row + 4 + j, mask=w_mask, other=0.0).to(tl.float32)
            x_sum += x_lo + x_hi
            if DENORMAL:
                # bits q << 4j as a float: q * 2^(4j - 149); times x * 2^(85 - 4j)
                factor = 38685626227668133590597632.0 / (1 << (4 * j))  # 2^85 / 16^j
                lo = (packed & (0xF << (4 * j))).to(tl.float32, bitcast=True)
                hi = (high & (0xF << (4 * j))).to(tl.float32, bitcast=True)
            else:
                factor = 1.0 / (1 << (4 * j))
                lo = ((packed & (0xF << (4 * j))) | 0x4B000000).to(tl.float32, bitcast=True)
                hi = ((high & (0xF << (4 * j))) | 0x4B000000).to(tl.float32, bitcast=True)
                lo -= 8388608.0
                hi -= 8388608.0
            dot += lo * (x_lo * factor)[:, None]
            dot += hi * (x_hi * factor)[:, None]
        if PER_ROW:
            acc += tl.sum(dot, axis=0)
            x_total += x_sum
        elif GROUP_WORDS >= BLOCK_W:  # the tile lies in one group
            group = w_start // GROUP_WORDS
            zero = tl.load(zero_ptr + group * stride_scale + offs_n, mask=n_mask, other=0)
            scale = tl.load(scale_ptr + group * stride_scale + offs_n, mask=n_mask, other=0.0)
            if DENORMAL:
                sums = tl.sum(dot, axis=0) * 18446744073709551616.0  # 2^64
            else:
                sums = tl.sum(dot, axis=0)
            acc += scale * (sums - zero.to(tl.float32) * tl.sum(x_sum, axis=0))
        else:  # several groups per tile: each word row's own
            at = (rows // GROUP_WORDS).to(tl.int64)[:, None] * stride_scale + offs_n[None, :]
            g_mask = w_mask[:, None] & n_mask[None, :]
            zero = tl.load(zero_ptr + at, mask=g_mask, other=0).to(tl.float32)
            scale = tl.load(scale_ptr + at, mask=g_mask, other=0.0)
            if DENORMAL:
                dot = dot * 18446744073709551616.0
            acc += tl.sum(scale * (dot - zero * x_sum[:, None]), axis=0)
    if PER_ROW:
        zero = tl.load(zero_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)
        scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
        if DENORMAL:
            acc = acc * 18446744073709551616.0
        acc = scale * (acc - zero * tl.sum(x_total, axis=0))
    if SPLIT:
        tl.store(out_ptr + tl.program_id(1).to(tl.int64) * out_features + offs_n, acc,
                 mask=n_mask)  # fmt: skip
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _int4_split_sum_kernel(
    partial_ptr,  # float32 [splits, N]
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [N]
    splits,
    out_features,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[n] = sum_s partial[s, n] (+ bias[n]), in x's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < out_features
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(partial_ptr + s * out_features + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _denormal_probe_kernel(bits_ptr, out_ptr):
    """out[0] = (bits[0], an int32 1, read as a float) * 2^100 * 2^49: 1.0 where
    arithmetic keeps denormal inputs (loaded, so that no compiler folds it)."""
    tiny = tl.load(bits_ptr + tl.arange(0, 1)).to(tl.float32, bitcast=True)
    tl.store(out_ptr + tl.arange(0, 1), tiny * 1.2676506002282294e30 * 562949953421312.0)


@triton.jit(do_not_specialize=["num_rows"])
def _int4_dot_kernel(
    x_ptr,  # [M, K]
    words_ptr,  # int32 [K/8, N]
    scale_ptr,  # float32 [G, N]
    zero_ptr,  # uint8 [G, N]
    bias_ptr,
    out_ptr,  # [M, N]
    num_rows,
    in_words,
    out_features,
    stride_x,
    stride_out,
    stride_words,
    stride_scale,
    group_words,  # word rows per group (in_words when one per output)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,  # word rows per K chunk (divides group_words)
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # the interpreter's tl.dot is wrong on 16-bit operands: fp32 there
):
    """out[m, n] = sum_k x[m, k] * W[n, k] over a [BLOCK_M, BLOCK_N] tile."""
    BLOCK_K: tl.constexpr = BLOCK_W * 8
    dtype = x_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < out_features
    m_mask = offs_m < num_rows
    offs_w = tl.arange(0, BLOCK_W)
    offs_k = tl.arange(0, BLOCK_K)
    shifts = (tl.arange(0, 8) * 4)[None, :, None]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for w_start in range(0, in_words, BLOCK_W):
        rows = w_start + offs_w
        w_mask = rows < in_words
        packed = tl.load(words_ptr + rows.to(tl.int64)[:, None] * stride_words + offs_n[None, :],
                         mask=w_mask[:, None] & n_mask[None, :], other=0)  # fmt: skip
        q = (packed[:, None, :] >> shifts) & 0xF  # [BLOCK_W, 8, BLOCK_N]
        q = tl.reshape(q, [BLOCK_K, BLOCK_N])
        group = (w_start // group_words) * stride_scale
        zero = tl.load(zero_ptr + group + offs_n, mask=n_mask, other=0).to(tl.float32) + 8388608.0
        scale = tl.load(scale_ptr + group + offs_n, mask=n_mask, other=0.0)
        w = ((q | 0x4B000000).to(tl.float32, bitcast=True) - zero[None, :]) * scale[None, :]
        k_mask = (w_start * 8 + offs_k) < in_words * 8
        x = tl.load(x_rows + w_start * 8 + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        w = w.to(dtype)
        if DOT_FP32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def unpack_int4_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] -> uint8 [N, K]: input k of output n from bits 4 * (k % 8)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    values = (words.unsqueeze(1) >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    return values.reshape(-1, words.shape[1]).t().to(torch.uint8)


def pack_int4_words(values: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values in [0, 16), K % 8 == 0 -> int32 [K/8, N] (``unpack_int4_words``'s
    inverse)."""
    rows, cols = values.shape
    nibbles = values.t().reshape(cols // 8, 8, rows).to(torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=values.device)
    return (nibbles << shifts[None, :, None]).sum(dim=1, dtype=torch.int32)


def dequantize_int4_reference(words, scale, zero, group: int) -> torch.Tensor:
    """float32 [N, K] = (q - zero) * scale, one (scale, zero) per ``group`` inputs."""
    values = unpack_int4_words(words).to(torch.float32)
    cols = values.shape[1]
    zero = zero.t().to(torch.float32).repeat_interleave(group, 1)[:, :cols]
    scale = scale.t().to(torch.float32).repeat_interleave(group, 1)[:, :cols]
    return (values - zero) * scale


def int4_linear_reference(x, words, scale, zero, group: int, bias=None) -> torch.Tensor:
    """Pure-torch ``int4_linear``: dequantize to x's dtype, then F.linear."""
    return F.linear(x, dequantize_int4_reference(words, scale, zero, group).to(x.dtype), bias)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fits_int4_kernels(x: torch.Tensor, words, scale, zero, group: int) -> bool:
    """Whether the Triton kernels take these inputs (else the reference runs)."""
    cols = words.shape[0] * 8
    per_row = group >= cols
    return (
        x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and words.dtype == torch.int32
        and words.stride(1) == 1
        and scale.dtype == torch.float32
        and zero.dtype == torch.uint8
        and scale.stride(1) == 1
        and zero.stride(1) == 1
        and scale.stride(0) == zero.stride(0)
        and (per_row or (group >= 16 and _pow2(group)))
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _keeps_denormals(device: torch.device) -> bool:
    """Whether float arithmetic keeps denormal inputs on ``device`` (the GEMV's two-
    instruction nibble): measured once by a one-element kernel (numpy's, interpreted)."""
    if device.type != "cuda":
        return bool(np.array([1], np.int32).view(np.float32)[0] * 2.0**100 * 2.0**49 == 1.0)
    out = torch.zeros(1, dtype=torch.float32, device=device)
    _denormal_probe_kernel[(1,)](torch.ones(1, dtype=torch.int32, device=device), out)
    return out.item() == 1.0


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_split(in_words: int, out_features: int, config: GemvConfig, waves: float,
               device: torch.device) -> tuple[int, int]:  # fmt: skip
    """(word rows per program, splits of K): enough programs for ``waves`` x the SMs, each
    at least two tiles of word rows."""
    block_w = config.block_k // 8
    columns = -(-out_features // config.block_n)
    want = max(1, round(waves * _sm_count(device) / columns))
    chunks = -(-in_words // block_w)
    splits = max(1, min(want, chunks // 2))
    per_split = -(-chunks // splits) * block_w
    return per_split, -(-in_words // per_split)


def int4_gemv_candidates() -> list[tuple[GemvConfig, float]]:
    """(tile, waves of programs) pairs the CUDA tuner measures, the first the default: the
    fastest of a 173-tile sweep on the Llama-3.1-8B layers (H200, docs/benchmarks.md),
    256-2048 outputs by 4-16 word rows. block_k counts inputs (8 per word row)."""
    return [
        (GemvConfig(block_n, block_w * 8, warps, stages), float(waves))
        for block_n, block_w, warps, stages, waves in (
            (256, 16, 4, 2, 4), (256, 16, 4, 3, 2), (1024, 4, 4, 1, 4), (2048, 4, 8, 1, 2),
            (512, 8, 4, 1, 8), (512, 8, 4, 1, 2), (512, 16, 8, 3, 2), (256, 8, 4, 2, 4),
        )
    ]  # fmt: skip


def int4_gemv(x, words, scale, zero, group: int, bias=None, config: GemvConfig | None = None,
              waves: float = 4.0, denormal: bool | None = None):  # fmt: skip
    """One row of ``int4_linear``. ``config`` / ``waves`` override the launch (block_k counts
    inputs; waves: programs per SM the K split aims at); else on CUDA the fastest of
    ``int4_gemv_candidates`` measured at the shape's first call, elsewhere (and under
    capture) their first. ``denormal`` (tests) forces the nibble's form."""
    in_words, rows = words.shape
    per_row = group >= in_words * 8
    if config is None:
        candidates = int4_gemv_candidates()
        config, waves = candidates[0]
        if not x.is_cuda:  # the interpreter pays per program: few, big ones
            config = GemvConfig(64, 64 if per_row else max(64, min(group, 128)), 4, 1)
            waves = 1.0
        else:
            key = ("int4", rows, in_words * 8, group, x.dtype, bias is not None)
            config, waves = tuned_quant_gemv(
                key, candidates, x.device,
                lambda c: int4_gemv(x, words, scale, zero, group, bias, *c),
            )  # fmt: skip
    if denormal is None:
        denormal = _keeps_denormals(x.device)
    per_split, splits = gemv_split(in_words, rows, config, waves, x.device)
    out = torch.empty(1, rows, dtype=x.dtype, device=x.device)
    target = out if splits == 1 else torch.empty(splits, rows, dtype=torch.float32,
                                                 device=x.device)  # fmt: skip
    _int4_gemv_kernel[(triton.cdiv(rows, config.block_n), splits)](
        x, words, scale, zero, bias if bias is not None else out, target,
        in_words, rows, per_split, words.stride(0), scale.stride(0),
        HAS_BIAS=bias is not None, PER_ROW=per_row, GROUP_WORDS=max(group // 8, 1),
        BLOCK_N=config.block_n, BLOCK_W=config.block_k // 8, SPLIT=splits > 1,
        DENORMAL=denormal, NUM_STAGES=config.num_stages, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        _int4_split_sum_kernel[(triton.cdiv(rows, 1024),)](
            target, bias if bias is not None else out, out, splits, rows,
            HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4,
        )  # fmt: skip
    return out


def int4_dot(x, words, scale, zero, group: int, bias=None):
    """``int4_linear`` through ``_int4_dot_kernel`` (any number of rows)."""
    in_words, rows = words.shape
    group_words = group // 8 if group < in_words * 8 else in_words
    block_m = 16 if x.shape[0] <= GEMV_MAX_ROWS else 64
    block_n = 32 if x.shape[0] <= GEMV_MAX_ROWS else 128
    block_w = 8
    while block_w > 2 and group_words % block_w:
        block_w //= 2
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, block_n), triton.cdiv(x.shape[0], block_m))
    _int4_dot_kernel[grid](
        x, words, scale, zero, bias if bias is not None else out, out,
        x.shape[0], in_words, rows, x.stride(0), out.stride(0), words.stride(0),
        scale.stride(0), group_words,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_W=block_w,
        PRECISION=dot_precision(x.dtype), DOT_FP32=_interpreting(), num_warps=4,
        num_stages=3,
    )  # fmt: skip
    return out


def int4_linear(x, words, scale, zero, group: int, bias=None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for x [..., K], W the dequantized int4 weight.

    On CUDA (or under TRITON_INTERPRET=1): one row the GEMV kernel, more rows the dot
    kernel; inputs the kernels do not take, or no Triton, the reference."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.shape[0] == 0 or not use_triton(x) or not fits_int4_kernels(x, words, scale, zero, group):
        out = int4_linear_reference(x, words, scale, zero, group, bias)
    elif x.shape[0] == 1:
        out = int4_gemv(x, words, scale, zero, group, bias)
    else:
        out = int4_dot(x, words, scale, zero, group, bias)
    return out.reshape(*shape[:-1], words.shape[1])

"""Linear layers with int4 weights (w4a16): a GEMV for decode, a GEMM for more rows.

y = x @ W^T (+ bias) with W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = k // group:
the one layout GPTQ, AWQ and compressed-tensors' pack-quantized are converted to at load
(atom/models/quantization/int4.py). ``packed`` is uint8 [N, K/2] (input 2j in the low nibble
of byte j, 2j + 1 in the high one): read as int32 words [N, K/8], input k sits at bits
4 * (k % 8) of word k // 8, so a kernel loads 8 inputs per 4 bytes.

Shapes and dtypes:
    x        [M, K] bf16/fp16/fp32, unit-stride columns (M: a runtime length), K % 8 == 0.
    packed   uint8 [N, K/2], unit-stride columns, rows 4-byte aligned.
    scale    float32 [N, G]; zero uint8 [N, G] (8 for symmetric checkpoints); G = ceil(K /
             group); group: a power of two >= 16, or K (one scale per output row).
    out      [M, N], x's dtype.

Kernels:
- ``_int4_gemv_kernel`` (one row: batch-1 decode). No tl.dot: each program owns BLOCK_N
  output rows and walks K in chunks of GROUPS groups of GROUP_WORDS words: a [BLOCK_N,
  GROUPS, GROUP_WORDS] word tile (contiguous: 16-byte loads), its nibbles spread over a last
  axis of 8 by shifts, each turned into a float without a conversion instruction (the bits
  q | 0x4B000000 are the float 2^23 + q, so one subtraction of 2^23 + zero gives q - zero);
  x is loaded in the same [BLOCK_N, GROUPS, GROUP_WORDS, 8] shape (contiguous, broadcast
  over rows). Group scales multiply each chunk's groups; per-row scales (PER_ROW) the sum
  once at the end. A small BLOCK_N gives several programs per SM: no split-K pass.
- ``_int4_gemv_words_kernel`` (one row): a 2-D [BLOCK_N, BLOCK_W] word tile, nibbles masked
  in place against x pre-scaled by 16^-j, the zero point and the scale once per word. The
  CUDA tuner measures its tiles beside the 4-D kernel's (``int4_gemv_candidates``); on the
  H200 it won only the Llama-8B o projection (docs/benchmarks.md).
- ``_int4_dot_kernel`` (2 rows and more): the [BLOCK_N, BLOCK_K] weight tile dequantized to
  x's dtype (as the reference's dequantized weight), tl.dot with fp32 accumulation;
  BLOCK_K divides the group.

Runtime lengths: M (``num_rows``, in do_not_specialize). Geometry (constexpr): tiles, the
group's words, bias or not. Weight offsets are int64.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from atom.kernels.gemv_tiles import (
    GemvConfig,
    quant_gemv_candidates,
    quant_gemv_config,
    tuned_quant_gemv,
)
from atom.kernels.platform import dot_precision, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)

GEMV_MAX_ROWS = 16
_TWO_23 = 8388608.0  # the float whose bits are 0x4B000000


@triton.jit
def _int4_gemv_kernel(
    x_ptr,  # [K], unit-stride
    weight_ptr,  # int32 words [N, K/8]
    scale_ptr,  # float32 [N, G]
    zero_ptr,  # uint8 [N, G]
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [N]
    in_words,  # K / 8
    out_features,
    stride_weight,  # in words
    stride_scale,  # of scale and zero
    HAS_BIAS: tl.constexpr,
    PER_ROW: tl.constexpr,  # one (scale, zero) per output row
    GROUPS: tl.constexpr,  # groups per K chunk (PER_ROW: 1)
    GROUP_WORDS: tl.constexpr,  # words per group (PER_ROW: the chunk's)
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    X_ONCE: tl.constexpr = False,  # x loaded [1, ...] and broadcast (else in the tile's shape)
):
    """One row: out[n] = sum_k (q[n, k] - zero[n, g]) * scale[n, g] * x[k] for BLOCK_N rows."""
    BLOCK_W: tl.constexpr = GROUPS * GROUP_WORDS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    n4 = offs_n[:, None, None, None]
    n_mask4 = n_mask[:, None, None, None]
    rows = weight_ptr + n4.to(tl.int64) * stride_weight
    scale_row = scale_ptr + n4.to(tl.int64) * stride_scale
    zero_row = zero_ptr + n4.to(tl.int64) * stride_scale
    groups = tl.arange(0, GROUPS)[None, :, None, None]
    words = groups * GROUP_WORDS + tl.arange(0, GROUP_WORDS)[None, None, :, None]
    nibbles = tl.arange(0, 8)[None, None, None, :]
    # x's offsets in the tile's full shape (broadcast over rows: L1 hits)
    x_cols_once = words * 8 + nibbles
    x_cols = x_cols_once + tl.zeros([BLOCK_N, 1, 1, 1], dtype=tl.int32)
    acc = tl.zeros([BLOCK_N, GROUPS, GROUP_WORDS, 8], dtype=tl.float32)
    # the magic float's offset, with the zero point (one per row when PER_ROW)
    offset = tl.load(zero_row, mask=n_mask4, other=0).to(tl.float32) + 8388608.0
    for w_start in tl.range(0, in_words, BLOCK_W, num_stages=NUM_STAGES):
        offs_w = w_start + words
        w_mask = offs_w < in_words
        packed = tl.load(rows + offs_w, mask=n_mask4 & w_mask, other=0,
                         eviction_policy="evict_first")  # fmt: skip
        q = (packed >> (nibbles * 4)) & 0xF
        if X_ONCE:
            x = tl.load(
                x_ptr + w_start * 8 + x_cols_once,
                mask=(w_start + x_cols_once // 8) < in_words,
                other=0.0,
            ).to(tl.float32)
        else:
            x = tl.load(x_ptr + w_start * 8 + x_cols, mask=(w_start + x_cols // 8) < in_words,
                        other=0.0).to(tl.float32)  # fmt: skip
        if PER_ROW:
            w = (q | 0x4B000000).to(tl.float32, bitcast=True) - offset
        else:
            group_ids = w_start // GROUP_WORDS + groups
            g_mask = n_mask4 & (group_ids * GROUP_WORDS < in_words)
            zero = tl.load(zero_row + group_ids, mask=g_mask, other=0).to(tl.float32)
            scale = tl.load(scale_row + group_ids, mask=g_mask, other=0.0)
            w = ((q | 0x4B000000).to(tl.float32, bitcast=True) - (zero + 8388608.0)) * scale
        acc += w * x
    out = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)
    if PER_ROW:
        out = out * tl.load(scale_ptr + offs_n.to(tl.int64) * stride_scale, mask=n_mask)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _int4_gemv_words_kernel(
    x_ptr,  # [K], unit-stride
    weight_ptr,  # int32 words [N, K/8]
    scale_ptr,  # float32 [N, G]
    zero_ptr,  # uint8 [N, G]
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [N]
    in_words,  # K / 8
    out_features,
    stride_weight,  # in words
    stride_scale,  # of scale and zero
    HAS_BIAS: tl.constexpr,
    PER_ROW: tl.constexpr,  # one (scale, zero) per output row
    GROUP_WORDS: tl.constexpr,  # words per group (PER_ROW: unused)
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,  # words per K chunk
    NUM_STAGES: tl.constexpr,
):
    """One row, on a 2-D [BLOCK_N, BLOCK_W] word tile (no 4-D tile, no layout conversion):
    out[n] = sum_g scale[n, g] * (sum_{k in g} q[n, k] x[k] - zero[n, g] sum_{k in g} x[k]).

    Nibble j of a word (j < 4: of the word, else of the word >> 16) is masked in place, not
    shifted down: (bits & 0xF << 4j) | 0x4B000000 is the float 2^23 + q * 16^j, so one
    subtraction gives q * 16^j exactly, and x[8w + j] is scaled by 16^-j once per program
    (a power of two: exact). A weight costs an AND, an OR, a subtraction and an FMA; the
    zero point and the scale are applied once per word, x's 8 loads per word are shared by
    the rows a thread holds."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    rows = weight_ptr + offs_n.to(tl.int64)[:, None] * stride_weight
    scale_row = scale_ptr + offs_n.to(tl.int64)[:, None] * stride_scale
    zero_row = zero_ptr + offs_n.to(tl.int64)[:, None] * stride_scale
    offs_w = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    x_sums = tl.zeros([BLOCK_W], dtype=tl.float32)  # PER_ROW: sum of x over the row's chunk
    for w_start in tl.range(0, in_words, BLOCK_W, num_stages=NUM_STAGES):
        cols = w_start + offs_w
        w_mask = cols < in_words
        packed = tl.load(rows + cols[None, :], mask=n_mask[:, None] & w_mask[None, :], other=0,
                         eviction_policy="evict_first")  # fmt: skip
        high = packed >> 16
        x_word = x_ptr + cols.to(tl.int64) * 8
        dot = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        x_sum = tl.zeros([BLOCK_W], dtype=tl.float32)
        for j in tl.static_range(4):
            x_lo = tl.load(x_word + j, mask=w_mask, other=0.0).to(tl.float32)
            x_hi = tl.load(x_word + 4 + j, mask=w_mask, other=0.0).to(tl.float32)
            x_sum += x_lo + x_hi
            w_lo = ((packed & (0xF << (4 * j))) | 0x4B000000).to(tl.float32, bitcast=True)
            w_hi = ((high & (0xF << (4 * j))) | 0x4B000000).to(tl.float32, bitcast=True)
            dot += (w_lo - 8388608.0) * (x_lo * (1.0 / (1 << (4 * j))))[None, :]
            dot += (w_hi - 8388608.0) * (x_hi * (1.0 / (1 << (4 * j))))[None, :]
        if PER_ROW:
            acc += dot
            x_sums += x_sum
        else:
            group_ids = cols // GROUP_WORDS
            g_mask = n_mask[:, None] & w_mask[None, :]
            zero = tl.load(zero_row + group_ids[None, :], mask=g_mask, other=0).to(tl.float32)
            scale = tl.load(scale_row + group_ids[None, :], mask=g_mask, other=0.0)
            acc += (dot - zero * x_sum[None, :]) * scale
    out = tl.sum(acc, axis=1)
    if PER_ROW:
        zero = tl.load(zero_ptr + offs_n.to(tl.int64) * stride_scale, mask=n_mask, other=0)
        out = (out - zero.to(tl.float32) * tl.sum(x_sums, axis=0)) * tl.load(
            scale_ptr + offs_n.to(tl.int64) * stride_scale, mask=n_mask, other=0.0
        )
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit(do_not_specialize=["num_rows"])
def _int4_dot_kernel(
    x_ptr,  # [M, K]
    weight_ptr,  # int32 words [N, K/8]
    scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,  # [M, N]
    num_rows,
    in_words,
    out_features,
    stride_x,
    stride_out,
    stride_weight,
    stride_scale,
    group_words,  # words per group (one row's K / 8 when per row)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,  # words per K chunk (divides group_words)
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
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    w_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * stride_weight
    scale_row = scale_ptr + offs_n.to(tl.int64) * stride_scale
    zero_row = zero_ptr + offs_n.to(tl.int64) * stride_scale
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for w_start in range(0, in_words, BLOCK_W):
        w_mask = (w_start + offs_w) < in_words
        packed = tl.load(w_rows + w_start + offs_w[None, :], mask=n_mask[:, None] & w_mask[None, :],
                         other=0)  # fmt: skip
        q = (packed[:, :, None] >> shifts) & 0xF  # [BLOCK_N, BLOCK_W, 8]
        q = tl.reshape(q, [BLOCK_N, BLOCK_K])
        group = w_start // group_words
        zero = tl.load(zero_row + group, mask=n_mask, other=0).to(tl.float32) + 8388608.0
        scale = tl.load(scale_row + group, mask=n_mask, other=0.0)
        w = ((q | 0x4B000000).to(tl.float32, bitcast=True) - zero[:, None]) * scale[:, None]
        k_mask = (w_start * 8 + offs_k) < in_words * 8
        x = tl.load(x_rows + w_start * 8 + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        w = w.to(dtype)
        if DOT_FP32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def dequantize_int4_reference(packed, scale, zero, group: int) -> torch.Tensor:
    """float32 [N, K] = (q - zero) * scale, one (scale, zero) per ``group`` inputs."""
    values = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    cols = values.shape[1]
    zero = zero.to(torch.float32).repeat_interleave(group, 1)[:, :cols]
    scale = scale.to(torch.float32).repeat_interleave(group, 1)[:, :cols]
    return (values.to(torch.float32) - zero) * scale


def int4_linear_reference(x, packed, scale, zero, group: int, bias=None) -> torch.Tensor:
    """Pure-torch ``int4_linear``: dequantize to x's dtype, then F.linear."""
    return F.linear(x, dequantize_int4_reference(packed, scale, zero, group).to(x.dtype), bias)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fits_int4_kernels(x: torch.Tensor, packed, scale, zero, group: int) -> bool:
    """Whether the Triton kernels take these inputs (else the reference runs)."""
    cols = packed.shape[1] * 2
    per_row = group >= cols
    return (
        x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and packed.dtype == torch.uint8
        and packed.stride(1) == 1
        and cols % 8 == 0
        and packed.stride(0) % 4 == 0
        and packed.data_ptr() % 4 == 0
        and scale.dtype == torch.float32
        and zero.dtype == torch.uint8
        and scale.stride(1) == 1
        and zero.stride(1) == 1
        and scale.stride(0) == zero.stride(0)
        and (per_row or (group >= 16 and _pow2(group)))
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _words(packed: torch.Tensor) -> torch.Tensor:
    return packed.view(torch.int32)


def int4_gemv_candidates(config: GemvConfig, group: int) -> list[tuple[GemvConfig, str]]:
    """The (tile, kernel) pairs the CUDA tuner measures, the heuristic's first: the 2-D word
    kernel ("words") at a few row counts and chunk widths, then the 4-D tile kernel's
    candidates ("tile", "x_once": x in the tile's shape or broadcast once)."""
    words = [
        (GemvConfig(block_n, block_w * 8, warps, 2), "words")
        for block_n, block_w, warps in ((8, 128, 4), (16, 128, 4), (32, 128, 4), (16, 256, 8),
                                        (4, 256, 4))  # fmt: skip
    ]
    tile = [(c, "x_once" if x_once else "tile") for c, x_once in quant_gemv_candidates(config, group)]
    return list(dict.fromkeys(words + tile))


def int4_gemv(x, packed, scale, zero, group: int, bias=None, config: GemvConfig | None = None,
              variant: str = "words"):  # fmt: skip
    """One row of ``int4_linear``. ``config`` and ``variant`` ("words": the 2-D word kernel;
    "tile" / "x_once": the 4-D tile kernel, x in the tile's shape or broadcast) override the
    launch (block_k counts inputs); else on CUDA the fastest of ``int4_gemv_candidates``
    measured at the shape's first call, elsewhere (and under capture) the word kernel's
    first tile."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    per_row = group >= cols
    if config is None:
        tile_group = 0 if per_row else group
        heuristic = quant_gemv_config(cols, rows, "int4", tile_group, x.is_cuda, x.device)
        candidates = int4_gemv_candidates(heuristic, tile_group)
        config, variant = candidates[0] if x.is_cuda else (heuristic, "words")
        if x.is_cuda:
            key = ("int4", rows, cols, group, x.dtype, bias is not None)
            config, variant = tuned_quant_gemv(
                key, candidates, x.device,
                lambda c: int4_gemv(x, packed, scale, zero, group, bias, *c),
            )  # fmt: skip
    words = _words(packed)
    out = torch.empty(1, rows, dtype=x.dtype, device=x.device)
    block_w = config.block_k // 8
    if variant == "words":
        _int4_gemv_words_kernel[(triton.cdiv(rows, config.block_n),)](
            x, words, scale, zero, bias if bias is not None else out, out,
            cols // 8, rows, words.stride(0), scale.stride(0),
            HAS_BIAS=bias is not None, PER_ROW=per_row, GROUP_WORDS=max(group // 8, 1),
            BLOCK_N=config.block_n, BLOCK_W=block_w, NUM_STAGES=config.num_stages,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
        return out
    group_words = block_w if per_row else group // 8
    _int4_gemv_kernel[(triton.cdiv(rows, config.block_n),)](
        x, words, scale, zero, bias if bias is not None else out, out,
        cols // 8, rows, words.stride(0), scale.stride(0),
        HAS_BIAS=bias is not None, PER_ROW=per_row, GROUPS=block_w // group_words,
        GROUP_WORDS=group_words, BLOCK_N=config.block_n, NUM_STAGES=config.num_stages,
        X_ONCE=variant == "x_once", num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def int4_dot(x, packed, scale, zero, group: int, bias=None):
    """``int4_linear`` through ``_int4_dot_kernel`` (any number of rows)."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    group_words = min(group, cols) // 8 if group < cols else -(-cols // 8)
    block_m = 16 if x.shape[0] <= GEMV_MAX_ROWS else 64
    block_n = 16 if x.shape[0] <= GEMV_MAX_ROWS else 128
    block_w = 16
    while block_w > 2 and group < cols and group_words % block_w:
        block_w //= 2
    words = _words(packed)
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, block_n), triton.cdiv(x.shape[0], block_m))
    _int4_dot_kernel[grid](
        x, words, scale, zero, bias if bias is not None else out, out,
        x.shape[0], cols // 8, rows, x.stride(0), out.stride(0), words.stride(0),
        scale.stride(0), group_words,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_W=block_w,
        PRECISION=dot_precision(x.dtype), DOT_FP32=_interpreting(), num_warps=4,
        num_stages=3,
    )  # fmt: skip
    return out


def int4_linear(x, packed, scale, zero, group: int, bias=None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for x [..., K], W the dequantized int4 weight.

    On CUDA (or under TRITON_INTERPRET=1): one row the GEMV kernel, more rows the dot
    kernel; inputs the kernels do not take, or no Triton, the reference."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.shape[0] == 0 or not use_triton(x) or not fits_int4_kernels(x, packed, scale, zero, group):
        out = int4_linear_reference(x, packed, scale, zero, group, bias)
    elif x.shape[0] == 1:
        out = int4_gemv(x, packed, scale, zero, group, bias)
    else:
        out = int4_dot(x, packed, scale, zero, group, bias)
    return out.reshape(*shape[:-1], packed.shape[0])

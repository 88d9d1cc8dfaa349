"""Linear layers with FP8 (e4m3) weights: a GEMV for decode, a GEMM for more rows.

y = x @ (weight * scale)^T (+ bias), the weight dequantized on the fly. Every scale layout
the loader produces (atom/models/quantization/fp8.py) is one shape here: ``scale`` float32
[ceil(N / scale_rows), ceil(K / scale_cols)], one value per (scale_rows x scale_cols)
block of the weight. Per-tensor and per-channel scales are (1, K) blocks (one per output
row); DeepSeek's and compressed-tensors' block scales are (128, 128) blocks, or (1, 128)
where a fused part starts inside a block.

Shapes and dtypes:
    x        [M, K] bf16/fp16/fp32, unit-stride columns (M: a runtime length).
    weight   [N, K] float8_e4m3fn, unit-stride columns.
    scale    float32 as above, unit-stride columns.
    bias     [N] or None.
    out      [M, N], x's dtype.

Kernels:
- ``_fp8_gemv_kernel`` (one row: batch-1 decode). No tl.dot: each program owns BLOCK_N
  output rows and walks K in chunks of GROUPS x GROUP_K inputs, loading the fp8 weight tile
  (contiguous along K: 16-byte loads) and x broadcast over the tile's rows; products summed
  in fp32. A small BLOCK_N gives thousands of programs (several per SM of the 132) so no
  split-K pass is needed. Per-row scales multiply the sum once at the end; block scales
  (GROUP_K = the scale's columns) multiply each chunk's [BLOCK_N, GROUPS] groups.
- ``_fp8_dot_kernel`` (2..16 rows, and the GEMM for more rows where ``torch._scaled_mm``
  is not taken): x tile [BLOCK_M, BLOCK_K] times the weight tile dequantized to x's dtype
  (block scales: w * scale rounded, as the reference's dequantized weight is), tl.dot with
  fp32 accumulation; per-row scales applied to the fp32 result.
- More than 16 rows on a GPU of compute capability >= 8.9 with per-row scales:
  ``torch._scaled_mm`` (FP8 tensor cores) with each activation row quantized to e4m3 at
  its own scale (dynamic per-token, as compressed-tensors' FP8_DYNAMIC runs).

Numerics: the GEMV and the dot kernel are weight-only (w8a16): x is not rounded to fp8.
The torch reference (``fp8_linear_reference``) dequantizes the weight to x's dtype, then
runs F.linear. Runtime lengths: M (``num_rows``, in do_not_specialize). Geometry (constexpr):
tiles, the scale's column block, bias or not. Weight offsets are int64.
"""

from __future__ import annotations

import functools
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

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GEMV_MAX_ROWS = 16  # up to here: the GEMV (one row) or the dot kernel with 16-row tiles


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [K], unit-stride
    weight_ptr,  # [N, K] fp8
    scale_ptr,  # [ceil(N / scale_rows), ceil(K / GROUP_K)] (PER_ROW: [N, 1]) float32
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [N]
    in_features,
    out_features,
    stride_weight,
    stride_scale,
    scale_rows,  # output rows per scale row (1 or the block's rows)
    HAS_BIAS: tl.constexpr,
    PER_ROW: tl.constexpr,  # one scale per output row, applied to the sum at the end
    GROUPS: tl.constexpr,  # scale groups per K chunk (PER_ROW: 1)
    GROUP_K: tl.constexpr,  # inputs per scale group (PER_ROW: the chunk)
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    X_ONCE: tl.constexpr = False,  # x loaded [1, ...] and broadcast (else in the tile's shape)
):
    """One row: out[n] = sum_k weight[n, k] * scale[n, k] * x[k] for BLOCK_N rows n."""
    BLOCK_K: tl.constexpr = GROUPS * GROUP_K
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    n3 = offs_n[:, None, None]
    n_mask3 = n_mask[:, None, None]
    rows = weight_ptr + n3.to(tl.int64) * stride_weight
    scale_row = scale_ptr + (n3 // scale_rows).to(tl.int64) * stride_scale
    groups = tl.arange(0, GROUPS)[None, :, None]
    # [1, GROUPS, GROUP_K] input offsets of a chunk; x is loaded in the tile's full shape
    # (broadcast over rows: L1 hits, no layout conversion)
    cols_once = groups * GROUP_K + tl.arange(0, GROUP_K)[None, None, :]
    cols = cols_once + tl.zeros([BLOCK_N, 1, 1], dtype=tl.int32)
    acc = tl.zeros([BLOCK_N, GROUPS, GROUP_K], dtype=tl.float32)
    for k_start in tl.range(0, in_features, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k_start + cols
        k_mask = offs_k < in_features
        w = tl.load(
            rows + offs_k, mask=n_mask3 & k_mask, other=0.0, eviction_policy="evict_first"
        ).to(tl.float32)
        if X_ONCE:
            x_offs = k_start + cols_once
            x = tl.load(x_ptr + x_offs, mask=x_offs < in_features, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if not PER_ROW:
            group_ids = k_start // GROUP_K + groups
            s_mask = n_mask3 & (group_ids * GROUP_K < in_features)
            w = w * tl.load(scale_row + group_ids, mask=s_mask, other=0.0)
        acc += w * x
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if PER_ROW:
        out = out * tl.load(scale_ptr + offs_n.to(tl.int64) * stride_scale, mask=n_mask)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit(do_not_specialize=["num_rows"])
def _fp8_dot_kernel(
    x_ptr,  # [M, K]
    weight_ptr,  # [N, K] fp8
    scale_ptr,
    bias_ptr,
    out_ptr,  # [M, N]
    num_rows,
    in_features,
    out_features,
    stride_x,
    stride_out,
    stride_weight,
    stride_scale,
    scale_rows,
    HAS_BIAS: tl.constexpr,
    PER_ROW: tl.constexpr,
    SCALE_K: tl.constexpr,  # inputs per scale column (not PER_ROW; a multiple of BLOCK_K)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # the interpreter's tl.dot is wrong on 16-bit operands: fp32 there
):
    """out[m, n] = sum_k x[m, k] * weight[n, k] * scale[n, k] over a [BLOCK_M, BLOCK_N]
    tile, the weight tile dequantized to x's dtype for tl.dot."""
    dtype = x_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < out_features
    m_mask = offs_m < num_rows
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    w_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * stride_weight
    scale_row = scale_ptr + (offs_n // scale_rows).to(tl.int64) * stride_scale
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        k_mask = (k_start + offs_k) < in_features
        x = tl.load(x_rows + k_start + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)  # fmt: skip
        w = tl.load(w_rows + k_start + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        if not PER_ROW:
            w = w * tl.load(scale_row + k_start // SCALE_K, mask=n_mask, other=0.0)[:, None]
        w = w.to(dtype)
        if DOT_FP32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if PER_ROW:
        scale = tl.load(scale_ptr + offs_n.to(tl.int64) * stride_scale, mask=n_mask, other=0.0)
        acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _quantize_rows_kernel(
    x_ptr,  # [M, K]
    out_ptr,  # [M, K] fp8, contiguous
    scale_ptr,  # [M] float32
    num_rows,
    in_features,
    stride_x,
    BLOCK_K: tl.constexpr,
):
    """Row m of x rounded to e4m3 at scale amax(|x[m]|) / 448 (two passes over the row:
    the max, then the rounding): the activations of the FP8 tensor-core GEMM, one launch."""
    row = tl.program_id(0)
    if row >= num_rows:
        return
    offs = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        x = tl.load(x_row + k_start + offs, mask=k_start + offs < in_features, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1.1754943508222875e-38)
    out_row = out_ptr + row.to(tl.int64) * in_features
    for k_start in range(0, in_features, BLOCK_K):
        mask = k_start + offs < in_features
        x = tl.load(x_row + k_start + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(out_row + k_start + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def dequantize_fp8_reference(weight, scale, block: tuple[int, int]) -> torch.Tensor:
    """float32 [..., N, K] = weight * scale, each scale covering a (rows, cols) block (a
    stack of experts [E, N, K] with scales [E, ...] too)."""
    rows, cols = weight.shape[-2:]
    full = scale.repeat_interleave(block[0], -2).narrow(-2, 0, rows)
    full = full.repeat_interleave(block[1], -1).narrow(-1, 0, cols)
    return weight.to(torch.float32) * full


def fp8_linear_reference(x, weight, scale, block, bias=None) -> torch.Tensor:
    """Pure-torch ``fp8_linear``: dequantize to x's dtype, then F.linear."""
    return F.linear(x, dequantize_fp8_reference(weight, scale, block).to(x.dtype), bias)


def _per_row(weight: torch.Tensor, block: tuple[int, int]) -> bool:
    return block[0] == 1 and block[1] >= weight.shape[1]


def fits_fp8_kernels(x: torch.Tensor, weight, scale, block: tuple[int, int]) -> bool:
    """Whether the Triton kernels take these inputs (else the reference runs)."""
    cols = block[1]
    return (
        x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dtype == FP8_DTYPE
        and weight.stride(1) == 1
        and scale.dtype == torch.float32
        and scale.stride(-1) == 1
        and (_per_row(weight, block) or (cols >= 16 and cols & (cols - 1) == 0))
        and (not x.is_cuda or fp8_capable(x.device))
    )


@functools.cache
def fp8_capable(device: torch.device) -> bool:
    """Triton converts e4m3 on compute capability >= 8.9 (Ada, Hopper and later)."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _dot_tiles(rows: int, block: tuple[int, int], weight) -> tuple[int, int, int]:
    block_m = 16 if rows <= GEMV_MAX_ROWS else 64
    block_n = 16 if rows <= GEMV_MAX_ROWS else 128
    block_k = 128 if _per_row(weight, block) else min(128, block[1])
    return block_m, block_n, block_k


def fp8_gemv(x, weight, scale, block, bias=None, config: GemvConfig | None = None,
             x_once: bool = False):  # fmt: skip
    """One row of ``fp8_linear`` through ``_fp8_gemv_kernel``; ``config`` (and ``x_once``)
    override the tile: else ``quant_gemv_config``'s, or on CUDA the fastest of its
    candidates measured at the shape's first call (``tuned_quant_gemv``)."""
    rows, cols = weight.shape
    per_row = _per_row(weight, block)
    if config is None:
        group = 0 if per_row else block[1]
        config = quant_gemv_config(cols, rows, "fp8", group, x.is_cuda, x.device)
        if x.is_cuda:
            key = ("fp8", rows, cols, block, x.dtype, bias is not None)
            config, x_once = tuned_quant_gemv(
                key, quant_gemv_candidates(config, group), x.device,
                lambda c: fp8_gemv(x, weight, scale, block, bias, *c),
            )  # fmt: skip
    group_k = config.block_k if per_row else block[1]
    out = torch.empty(1, rows, dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(rows, config.block_n),)](
        x, weight, scale, bias if bias is not None else out, out,
        cols, rows, weight.stride(0), scale.stride(0), block[0],
        HAS_BIAS=bias is not None, PER_ROW=per_row, GROUPS=config.block_k // group_k,
        GROUP_K=group_k, BLOCK_N=config.block_n, NUM_STAGES=config.num_stages,
        X_ONCE=x_once, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def fp8_dot(x, weight, scale, block, bias=None):
    """``fp8_linear`` through ``_fp8_dot_kernel`` (any number of rows)."""
    rows, cols = weight.shape
    block_m, block_n, block_k = _dot_tiles(x.shape[0], block, weight)
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, block_n), triton.cdiv(x.shape[0], block_m))
    _fp8_dot_kernel[grid](
        x, weight, scale, bias if bias is not None else out, out,
        x.shape[0], cols, rows, x.stride(0), out.stride(0), weight.stride(0),
        scale.stride(0), block[0],
        HAS_BIAS=bias is not None, PER_ROW=_per_row(weight, block),
        SCALE_K=block[1] if not _per_row(weight, block) else block_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=dot_precision(x.dtype), DOT_FP32=_interpreting(), num_warps=4,
        num_stages=3,
    )  # fmt: skip
    return out


@functools.cache
def _scaled_mm_supported(device: torch.device) -> bool:
    """torch._scaled_mm with row-wise scales needs FP8 tensor cores (compute capability
    >= 8.9) and a torch that has it."""
    return hasattr(torch, "_scaled_mm") and device.type == "cuda" and fp8_capable(device)


_SCALED_MM_FAILED: set = set()


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x rounded to e4m3 at one scale per row, the float32 scales [M, 1]):
    scale = amax(|row|) / 448. One Triton launch on CUDA (``_quantize_rows_kernel``)."""
    if use_triton(x) and x.dim() == 2 and x.stride(1) == 1:
        rows, cols = x.shape
        xq = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        block = min(4096, triton.next_power_of_2(cols))
        _quantize_rows_kernel[(rows,)](x, xq, scale, rows, cols, x.stride(0), BLOCK_K=block,
                                       num_warps=4)  # fmt: skip
        return xq, scale
    return quantize_rows_fp8_reference(x)


def quantize_rows_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch ``quantize_rows_fp8``."""
    scale = x.abs().amax(dim=-1, keepdim=True).to(torch.float32) / FP8_MAX
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    xq = (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, scale


def fp8_scaled_mm(x, weight, scale, bias=None) -> torch.Tensor:
    """FP8 tensor cores: x quantized per row (dynamic), the weight's per-row scales."""
    xq, x_scale = quantize_rows_fp8(x)
    out = torch._scaled_mm(
        xq, weight.t(), scale_a=x_scale, scale_b=scale.reshape(1, -1),
        out_dtype=torch.bfloat16 if x.dtype == torch.float32 else x.dtype,
    )  # fmt: skip
    out = out.to(x.dtype)
    return out if bias is None else out + bias


def _takes_scaled_mm(x, weight, block) -> bool:
    return (
        x.is_cuda
        and _per_row(weight, block)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 16 == 0
        and x.device not in _SCALED_MM_FAILED
        and _scaled_mm_supported(x.device)
    )


def fp8_linear(x, weight, scale, block: tuple[int, int], bias=None) -> torch.Tensor:
    """``x @ (weight * scale)^T (+ bias)`` for x [..., K].

    On CUDA (or under TRITON_INTERPRET=1): one row the GEMV kernel, 2..16 rows the dot
    kernel, more rows ``torch._scaled_mm`` (per-row scales on FP8 tensor cores) or the dot
    kernel; inputs the kernels do not take, or no Triton, the reference."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    if rows == 0 or not use_triton(x) or not fits_fp8_kernels(x, weight, scale, block):
        out = fp8_linear_reference(x, weight, scale, block, bias)
    elif rows == 1:
        out = fp8_gemv(x, weight, scale, block, bias)
    elif rows > GEMV_MAX_ROWS and _takes_scaled_mm(x, weight, block):
        try:
            out = fp8_scaled_mm(x, weight, scale, bias)
        except RuntimeError:  # this torch / device lacks row-wise scaled_mm: the dot kernel
            _SCALED_MM_FAILED.add(x.device)
            out = fp8_dot(x, weight, scale, block, bias)
    else:
        out = fp8_dot(x, weight, scale, block, bias)
    return out.reshape(*shape[:-1], weight.shape[0])

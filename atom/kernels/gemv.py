"""Batch-1 linear layers as a Triton GEMV, optionally with SiLU * up in the epilogue.

At batch 1 a decoder step's linear layers are matrix-vector products bound by reading the
weight once. cuBLAS adds a split-K reduce kernel to some of them, and the MLP's SiLU-and-mul
is a kernel of its own; these kernels read the weight in one pass and write the result
(``gemv``), or read the gate and up rows of the fused gate/up weight together and write
``silu(gate) * up`` directly (``gemv_silu_and_mul``): one launch instead of two or three.
``gemv_rms_norm`` also folds the RMSNorm before the layer (and its residual add) into the
GEMV: each program normalises the input row itself, so a decoder layer's two norms launch
nothing of their own. Used only with their Fusions switches (atom/fusions.py), at one row
(batch-1 decode), on the shapes where the GEMV policy measured them faster
(atom/kernels/gemv_policy.py): more rows run the torch references (F.linear: cuBLAS, which a
tl.dot GEMV for 2..16 rows lost to; that kernel is gone, docs/benchmarks.md).

Shapes and dtypes:
    x        [num_rows, in_features], fp32/bf16/fp16, unit-stride columns; the kernel
             takes num_rows == 1.
    weight   [out_features, in_features] (nn.Linear's layout), x's dtype, unit-stride
             columns. For ``gemv_silu_and_mul`` out_features = 2 * intermediate: gate rows
             then up rows (ColumnParallelLinear's [gate | up]). Or float8_e4m3fn with
    weight_scale  (FP8 only) float32 [out_features, 1] contiguous: one scale per weight row
             (FP8 per channel / per tensor, atom/models/quantization/fp8.py); block-scaled
             FP8 keeps atom/kernels/fp8_linear.py's GEMV and the separate kernels.
    out      [num_rows, out_features] (``gemv``) or [num_rows, intermediate], x's dtype.
    bias     optional [out_features] (``gemv``, ``gemv_rms_norm``, gemv_rope_kv.py), x's
             dtype: added to the fp32 sum before the rounding (F.linear's one rounding)
             and before the RoPE epilogue (Qwen2's qkv bias).

Numerics: fp32 accumulation (fp32 products summed along K per lane, then across lanes),
rounded to x's dtype as F.linear's output; with SiLU the gate and up are rounded first, then
silu in fp32 rounded, then the product rounded (atom/kernels/activation.py's order). The
summation order differs from cuBLAS, so a last bit may differ. An FP8 weight is widened to
fp32 and each row's sum multiplied by its scale (weight-only, w8a16: x is not quantized, as
fp8_linear.py's GEMV); the references dequantize the weight to x's dtype, then F.linear.

Kernel design (``_gemv_row_kernel``): no tl.dot (whose 16 padded rows would waste 15/16 of
the math and force BLOCK_N >= 16). Each program owns BLOCK_N (1..16) output rows and walks
K in BLOCK_K chunks, loading [BLOCK_N, BLOCK_K] weight tiles (contiguous along K: coalesced)
times x into a 2D fp32 accumulator that is reduced along K once at the end. x is loaded
broadcast over the tile's rows, in the tile's layout (L1 hits; a [BLOCK_K] load would be
converted through shared memory, with barriers, every chunk). A small BLOCK_N gives many
programs (several per SM) to hide the memory latency without a split-K pass; NUM_STAGES > 1
pipelines the K loop's loads through shared memory (cp.async: Triton pipelines no other
loads than a dot's by itself, so num_stages alone changes nothing). Tiles, warps and stages
come from ``gemv_config``: the tile the GEMV policy measured for the shape at engine start
(atom/kernels/gemv_policy.py, which also decides whether a layer runs this kernel at
all), else a heuristic. ``python -m benchmarks.gemv_sweep`` searches a wider grid.

With an FP8 weight (``ROW_SCALED``) the tile is the same [BLOCK_N, BLOCK_K], of 1-byte
elements (the policy's FP8 candidates take twice the chunk: 16-byte loads), and x is loaded
once per chunk as [1, BLOCK_K] and broadcast by the product (``X_ONCE``: the layout the FP8
GEMV's tuner measured about 2x faster on every 8B layer, docs/benchmarks.md).

With the norm: x (+ residual) rounded to x's dtype as rms_norm does (program 0 writes
x + residual, the next layer's residual stream); no prologue pass: the K loop that reads x
for the products also sums its squares and multiplies x by the norm weight (fp32,
unrounded), and the program scales its sums by 1 / RMS at the end:
W (w * x) / rms = W rms_norm(x). So the normalised row is never rounded to x's dtype, a
rounding the unfused path has (bf16: within its tolerance); each program still reads x
once, from L1/L2, as without the norm.

Under programmatic dependent launch (``PDL``, atom/kernels/pdl.py: the GEMVs of under 4 MB
of weight, which latency bounds) the program loads its first weight chunk, then waits for
the kernel before it, then reads x: the weight is never written by a forward, so its load
overlaps the previous kernel's tail (figures in docs/benchmarks.md).

Runtime lengths: none (one row). Geometry: in/out features (plain arguments: Triton
specializes them by divisibility by 16 only, which keeps the masked loads vectorised, so
one compiled variant per configuration serves every layer shape), and as constexprs the
tiles and whether the SiLU epilogue, the norm, the RoPE + KV epilogue and the FP8 row
scales run. Offsets are int64 (a 128K x 8K weight passes 2^31 elements).

No residual epilogue (out = residual + W x): every residual add of a Llama layer already
lives in the next RMSNorm kernel (rmsnorm.py) or, with ``norm_gemv``, in the next GEMV,
so moving it into o_proj / down would remove no kernel. No split-K either: a
small BLOCK_N gives enough programs (e.g. 2048 for the 1B shape's down projection at
BLOCK_N 1) without a second pass or a zeroed output.
"""

import torch

from atom.kernels.fp8_linear import FP8_DTYPE, fp8_capable
from atom.kernels.gemv_tiles import (  # noqa: F401 (GemvConfig, heuristic_config: this module's API)
    GemvConfig,
    GemvSite,
    chosen_tile,
    heuristic_config,
)
from atom.kernels.pdl import pdl_launch, pdl_release, pdl_wait_and_release
from atom.kernels.platform import use_triton
from atom.kernels.rmsnorm import rms_norm_reference
from atom.kernels.rope_kv_epilogue import RopeKV, _rope_kv_epilogue

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


@triton.jit
def _x_chunk(
    x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr, k_start, in_features,
    sum_squares, first_row, dtype: tl.constexpr, NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, X_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """x's chunk at k_start, fp32, [X_ROWS, BLOCK_K]: broadcast over the tile's rows (in the
    tile's layout: L1 hits) or one row broadcast by the product (X_ROWS 1); with NORM (+
    residual) x's squares are summed into ``sum_squares`` and x is multiplied by the norm
    weight (1 / RMS comes at the end)."""
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_offs = offs_k[None, :] + tl.zeros([X_ROWS, 1], dtype=tl.int32)
    x_mask = (offs_k < in_features)[None, :] & (x_offs >= 0)
    x = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
    if NORM:
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + x_offs, mask=x_mask, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
            if tl.program_id(0) == 0:  # x + residual: the next layer's residual stream
                tl.store(residual_out_ptr + x_offs, x, mask=x_mask & first_row)
        h = x.to(tl.float32)
        sum_squares += h * h
        norm_weight = tl.load(norm_weight_ptr + x_offs, mask=x_mask, other=0.0)
        x = norm_weight.to(tl.float32) * h
    return x.to(tl.float32), sum_squares


@triton.jit
def _weight_chunk(
    gate_rows, up_rows, k_start, in_features, n_mask, TWO_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The [BLOCK_N, BLOCK_K] weight tile(s) at k_start (the up / second-half rows too with
    TWO_ROWS). The weight is read once: it may leave L2 first (x and the next layer's stay)."""
    offs_k = k_start + tl.arange(0, BLOCK_K)
    w_mask = n_mask[:, None] & (offs_k < in_features)[None, :]
    gate = tl.load(
        gate_rows + offs_k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first"
    )
    up = gate
    if TWO_ROWS:
        up = tl.load(
            up_rows + offs_k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first"
        )
    return gate, up


@triton.jit
def _gemv_row_kernel(
    x_ptr,  # [in_features], unit-stride
    weight_ptr,
    out_ptr,  # [out_features]
    residual_ptr,  # NORM and HAS_RESIDUAL: added to x before the norm
    norm_weight_ptr,  # NORM: the RMSNorm weight [in_features]
    residual_out_ptr,  # NORM and HAS_RESIDUAL: x + residual, written by program 0
    in_features,
    out_features,  # of out: intermediate when SILU_MUL; ROPE_KV: the weight's rows
    eps,
    stride_weight,
    positions_ptr,  # ROPE_KV: [1] the token's position
    cos_ptr,  # ROPE_KV: [max_position, HEAD_DIM] (both halves, as RotaryEmbedding's)
    sin_ptr,
    stride_cos,
    k_cache_ptr,  # ROPE_KV: [slots, num_kv_heads, HEAD_DIM] contiguous, x's dtype
    v_cache_ptr,
    slot_mapping_ptr,  # ROPE_KV: [1] the token's cache slot (-1: padding, nothing written)
    num_q_heads,
    num_kv_heads,
    bias_ptr,  # HAS_BIAS: [weight rows], x's dtype, added before the epilogue
    weight_scale_ptr,  # ROW_SCALED: [weight rows] float32, one scale per weight row
    SILU_MUL: tl.constexpr,  # weight rows [gate | up]; out = silu(gate) * up
    NORM: tl.constexpr,  # x := rms_norm(x (+ residual)) * norm_weight first
    HAS_RESIDUAL: tl.constexpr,
    ROPE_KV: tl.constexpr,  # weight rows [q | k | v heads]: RoPE of q and k, k and v cached
    HEAD_DIM: tl.constexpr,  # ROPE_KV only
    HAS_BIAS: tl.constexpr,  # out = W x + bias (fp32 sum, one rounding: F.linear's)
    ROW_SCALED: tl.constexpr,  # FP8 weight: each row's fp32 sum times its scale
    X_ONCE: tl.constexpr,  # x loaded as one row, broadcast by the product (else tile-shaped)
    BLOCK_N: tl.constexpr,  # output rows per program, 1..16 (ROPE_KV: row pairs)
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # > 1: the K loop's loads pipelined through shared memory
    PDL: tl.constexpr = 0,  # programmatic dependent launch (atom/kernels/pdl.py)
):
    """One row: out[n] = sum_k weight[n, k] * x[k] for the program's BLOCK_N rows n. With
    ROPE_KV the program's rows are BLOCK_N rotary pairs (d, d + HEAD_DIM / 2) of a head."""
    dtype = x_ptr.dtype.element_ty
    if ROPE_KV:
        pairs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = pairs < out_features // 2
        head = pairs // (HEAD_DIM // 2)
        dim = pairs % (HEAD_DIM // 2)
        offs_n = head * HEAD_DIM + dim  # the first half's rows; the second's + HEAD_DIM / 2
        second_rows = offs_n + HEAD_DIM // 2
    else:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < out_features
        second_rows = offs_n + out_features  # SILU_MUL: the up rows
    # [BLOCK_N, BLOCK_K] tiles: row n of the weight, contiguous along K (coalesced loads).
    gate_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * stride_weight
    up_rows = weight_ptr + second_rows.to(tl.int64)[:, None] * stride_weight
    X_ROWS: tl.constexpr = 1 if X_ONCE else BLOCK_N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sum_squares = tl.zeros([X_ROWS, BLOCK_K], dtype=tl.float32)  # NORM: of x's row
    first_row = (tl.arange(0, X_ROWS) == 0)[:, None]
    k_first = 0
    if PDL > 0:
        # No kernel writes the weight: its first chunk is loaded while the previous
        # kernel still runs, then the program waits, and x's first chunk completes it.
        gate, up = _weight_chunk(
            gate_rows, up_rows, 0, in_features, n_mask, SILU_MUL or ROPE_KV, BLOCK_K
        )
        pdl_wait_and_release(PDL)
        x, sum_squares = _x_chunk(
            x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr, 0, in_features,
            sum_squares, first_row, dtype, NORM, HAS_RESIDUAL, X_ROWS, BLOCK_K,
        )  # fmt: skip
        acc += gate.to(tl.float32) * x
        if SILU_MUL or ROPE_KV:
            acc_up += up.to(tl.float32) * x
        k_first = BLOCK_K
    for k_start in tl.range(k_first, in_features, BLOCK_K, num_stages=NUM_STAGES):
        x, sum_squares = _x_chunk(
            x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr, k_start, in_features,
            sum_squares, first_row, dtype, NORM, HAS_RESIDUAL, X_ROWS, BLOCK_K,
        )  # fmt: skip
        gate, up = _weight_chunk(
            gate_rows, up_rows, k_start, in_features, n_mask, SILU_MUL or ROPE_KV, BLOCK_K
        )
        acc += gate.to(tl.float32) * x
        if SILU_MUL or ROPE_KV:
            acc_up += up.to(tl.float32) * x
    pdl_release(PDL)
    out = tl.sum(acc, axis=1)
    second = out  # never read without SILU_MUL / ROPE_KV
    if SILU_MUL or ROPE_KV:
        second = tl.sum(acc_up, axis=1)
    if ROW_SCALED:  # the FP8 weight's scale, once per row (w8a16: x is not quantized)
        out = out * tl.load(weight_scale_ptr + offs_n, mask=n_mask, other=0.0)
        if SILU_MUL or ROPE_KV:
            second = second * tl.load(weight_scale_ptr + second_rows, mask=n_mask, other=0.0)
    if NORM:  # every row of sum_squares holds x's whole sum
        rstd = tl.rsqrt(tl.sum(sum_squares, axis=1) / in_features + eps)
        out = out * rstd
        second = second * rstd
    if HAS_BIAS:  # the gate / up or the rotary pair's second rows have their own entries
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if SILU_MUL or ROPE_KV:
            second += tl.load(bias_ptr + second_rows, mask=n_mask, other=0.0).to(tl.float32)
    if ROPE_KV:
        _rope_kv_epilogue(
            out, second, head, dim, n_mask, out_ptr, positions_ptr, cos_ptr,
            sin_ptr, stride_cos, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_q_heads,
            num_kv_heads, HEAD_DIM,
        )  # fmt: skip
        return
    if SILU_MUL:
        # rounded as F.linear's outputs, then as activation.py's silu and product
        gate = out.to(dtype).to(tl.float32)
        up = second.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        out = silu.to(tl.float32) * up
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)  # x's, or fp32


def gemv_config(
    in_features: int,
    out_features: int,
    silu_mul: bool,
    norm: bool,
    on_gpu: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | None = None,
    rope: bool = False,
    bias: bool = False,
    weight_dtype: torch.dtype | None = None,
) -> GemvConfig:
    """The launch geometry for a weight [out_features, in_features] (out_features counts the
    weight's rows: 2 * intermediate with ``silu_mul``). On the GPU: the tile the GEMV policy
    measured for this shape (atom/kernels/gemv_policy.py), else ``heuristic_config``.
    ``weight_dtype``: an FP8 weight's (None: x's dtype)."""
    rows = out_features // 2 if silu_mul else out_features
    if not on_gpu:  # the interpreter pays per program: few, big ones
        return GemvConfig(min(64, triton.next_power_of_2(rows)), 128, 4, 1)
    dtype_name = str(dtype).removeprefix("torch.")
    weight_name = None if weight_dtype is None else str(weight_dtype).removeprefix("torch.")
    site = GemvSite(in_features, out_features, silu_mul, norm, dtype_name, rope, bias, weight_name)
    tile = chosen_tile(site, device or torch.device("cuda"))
    if tile is not None:
        return tile
    return heuristic_config(in_features, out_features, silu_mul, weight_name)


def fits_gemv(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None
) -> bool:
    """Whether the kernel takes these inputs: one row, unit-stride columns, and a weight of
    x's dtype, or (``weight_scale``) an FP8 e4m3 weight with one float32 scale per row
    [rows, 1] (on a GPU that converts e4m3: compute capability >= 8.9)."""
    if not (x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1 and weight.stride(1) == 1):
        return False
    if weight_scale is None:
        return x.dtype == weight.dtype
    return (
        weight.dtype == FP8_DTYPE
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and weight_scale.dtype == torch.float32
        and weight_scale.shape == (weight.shape[0], 1)
        and weight_scale.is_contiguous()
        and (not x.is_cuda or fp8_capable(x.device))
    )


def _flags(
    silu_mul: bool,
    norm: bool,
    has_residual: bool,
    config: GemvConfig,
    bias: bool = False,
    row_scaled: bool = False,
) -> dict:
    return dict(
        SILU_MUL=silu_mul,
        NORM=norm,
        HAS_RESIDUAL=has_residual,
        ROPE_KV=False,
        HEAD_DIM=1,
        HAS_BIAS=bias,
        # FP8: x loaded once per chunk (the FP8 GEMV's measured layout, fp8_linear.py X_ONCE)
        ROW_SCALED=row_scaled,
        X_ONCE=row_scaled,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def compile_row_kernel(
    in_features: int,
    out_features: int,
    silu_mul: bool,
    norm: bool,
    has_residual: bool,
    config: GemvConfig,
    dtype: torch.dtype = torch.bfloat16,
    bias: bool = False,
) -> None:
    """Compile the one-row kernel for this geometry without launching it (Triton's
    ``warmup``; under its AsyncCompileMode the compile joins a pool: the sweep compiles its
    grid ahead in parallel). Arguments as ``_launch`` gives them, pointers as dtypes."""
    _gemv_row_kernel.warmup(
        dtype, dtype, dtype, dtype, dtype, dtype,
        in_features, out_features, 1e-5, in_features, *(dtype,) * 3, 16, *(dtype,) * 3, 1,
        1, dtype, dtype, grid=(1,), NUM_STAGES=config.num_stages,
        **_flags(silu_mul, norm, has_residual, config, bias),
    )  # fmt: skip


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    silu_mul: bool,
    norm: tuple | None = None,  # (residual or None, norm weight, eps, residual_out or None)
    config: GemvConfig | None = None,
    rope: RopeKV | None = None,  # one row: out is q, the k and v heads go to the caches
    bias: torch.Tensor | None = None,  # [weight rows], x's dtype
    weight_scale: torch.Tensor | None = None,  # FP8 weight: [weight rows, 1] float32
) -> None:
    assert fits_gemv(x, weight, weight_scale), (
        "x [1, K], weight [N, K] of x's dtype (or e4m3 with a float32 scale [N, 1])"
    )
    assert weight.shape[1] == x.shape[1]
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.dtype == x.dtype
        assert bias.is_contiguous()
    in_features, out_features = x.shape[1], out.shape[1]
    if config is None:
        config = gemv_config(in_features, weight.shape[0], silu_mul, norm is not None,
                             x.is_cuda, x.dtype, x.device, rope is not None,
                             bias is not None,
                             None if weight_scale is None else weight.dtype)  # fmt: skip
    residual, norm_weight, eps, residual_out = norm or (None, x, 0.0, None)
    if residual is None:  # never read
        residual = residual_out = x
    grid = (triton.cdiv(out_features, config.block_n),)
    has_residual = norm is not None and norm[0] is not None
    flags = _flags(silu_mul, norm is not None, has_residual, config, bias is not None,
                   weight_scale is not None)  # fmt: skip
    rope_args = (*(x,) * 3, 16, *(x,) * 3, 1, 1)  # never read without ROPE_KV
    if rope is not None:  # the program's rows: BLOCK_N // 2 rotary pairs (the same bytes)
        pairs = max(1, config.block_n // 2)
        grid = (triton.cdiv(weight.shape[0] // 2, pairs),)
        out_features = weight.shape[0]
        flags.update(ROPE_KV=True, HEAD_DIM=rope.head_dim, BLOCK_N=pairs)
        rope_args = rope.arguments()
    pdl, launch = pdl_launch(x, weight.numel() * weight.element_size())
    _gemv_row_kernel[grid](
        x, weight, out, residual, norm_weight, residual_out,
        in_features, out_features, eps, weight.stride(0), *rope_args,
        x if bias is None else bias, x if weight_scale is None else weight_scale,
        NUM_STAGES=config.num_stages, PDL=pdl, **flags, **launch,
    )  # fmt: skip


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: F.linear (``weight_scale``: of the FP8 weight times its
    scale per row). ``out_dtype`` float32 (no weight scale): the fp32 sums unrounded, as
    ``F.linear(x.float(), weight.float())`` gives them (bf16 / fp16 products are exact in
    fp32), without a float32 copy of the weight.

    One row runs the Triton kernel on CUDA (or under TRITON_INTERPRET=1); more rows, or no
    Triton, the reference. ``config`` overrides ``gemv_config`` (the sweep's candidates).
    """
    out_dtype = out_dtype or x.dtype
    assert out_dtype in (x.dtype, torch.float32) and (out_dtype == x.dtype or weight_scale is None)
    if not use_triton(x) or x.shape[0] != 1:
        if out_dtype != x.dtype:
            return gemv_reference(x.float(), weight.float(), None if bias is None else bias.float())
        return gemv_reference(x, weight, bias, weight_scale)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype, device=x.device)
    _launch(x, weight, out, silu_mul=False, config=config, bias=bias, weight_scale=weight_scale)
    return out


def gemv_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ weight.T = [gate | up]`` (``weight_scale``: of the FP8
    weight times its scale per row).

    One row runs the Triton kernel on CUDA (or under TRITON_INTERPRET=1); more rows, or no
    Triton, the reference. ``config`` overrides ``gemv_config``.
    """
    if not use_triton(x) or x.shape[0] != 1:
        return gemv_silu_and_mul_reference(x, weight, weight_scale)
    assert weight.shape[0] % 2 == 0, "weight holds gate | up rows"
    out = torch.empty(x.shape[0], weight.shape[0] // 2, dtype=x.dtype, device=x.device)
    _launch(x, weight, out, silu_mul=True, config=config, weight_scale=weight_scale)
    return out


def gemv_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    silu_mul: bool = False,
    config: GemvConfig | None = None,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (with the residual add) and the linear layer after it, in one kernel.

    Returns ``(gemv(h, weight), x + residual)`` (or ``gemv_silu_and_mul`` with
    ``silu_mul``), h = ``rms_norm(x, norm_weight, eps, residual)``; without ``residual``
    the second item is ``x`` itself, as ``PreNormDecoderLayer`` carries it. ``norm_weight``
    [in_features] has x's dtype. One row runs the Triton kernel on CUDA (or under
    TRITON_INTERPRET=1); more rows, or no Triton, the reference. ``config`` overrides
    ``gemv_config``. ``bias`` (not with ``silu_mul``): the linear layer's. ``weight_scale``:
    an FP8 weight's, one per row.
    """
    assert bias is None or not silu_mul, "no bias with the SiLU epilogue"
    if not use_triton(x) or x.shape[0] != 1:
        return gemv_rms_norm_reference(
            x, residual, norm_weight, eps, weight, silu_mul, bias, weight_scale
        )
    hidden = x.shape[1]
    assert norm_weight.shape == (hidden,) and norm_weight.dtype == x.dtype
    assert norm_weight.is_contiguous()
    residual_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(1) == 1
        residual_out = torch.empty_like(x)
    features = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty(x.shape[0], features, dtype=x.dtype, device=x.device)
    norm_args = (residual, norm_weight, eps, residual_out)
    _launch(x, weight, out, silu_mul, norm_args, config, bias=bias, weight_scale=weight_scale)
    return out, x if residual is None else residual_out


def gemv_rms_norm_reference(
    x, residual, norm_weight, eps, weight, silu_mul=False, bias=None, weight_scale=None
):
    """Pure-torch ``gemv_rms_norm``: ``rms_norm_reference`` then the linear layer."""
    if residual is None:
        h, residual = rms_norm_reference(x, norm_weight, eps), x
    else:
        h, residual = rms_norm_reference(x, norm_weight, eps, residual)
    if silu_mul:
        return gemv_silu_and_mul_reference(h, weight, weight_scale), residual
    return gemv_reference(h, weight, bias, weight_scale), residual


def dense_weight(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None
) -> torch.Tensor:
    """The weight F.linear takes: ``weight`` itself, or an FP8 one times its scale per row,
    rounded to x's dtype (as atom/kernels/fp8_linear.py's reference dequantizes)."""
    if weight_scale is None:
        return weight
    return (weight.to(torch.float32) * weight_scale).to(x.dtype)


def gemv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch ``gemv``: F.linear (of the dequantized weight)."""
    return torch.nn.functional.linear(x, dense_weight(x, weight, weight_scale), bias)


def gemv_silu_and_mul_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Pure-torch ``gemv_silu_and_mul``: F.linear, then silu(gate) * up."""
    weight = dense_weight(x, weight, weight_scale)
    gate, up = torch.nn.functional.linear(x, weight).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up

"""Routed experts of an MoE layer: a Triton grouped GEMM over (token, k) pairs sorted by
expert, beside its torch reference.

Shapes and dtypes (T tokens, k experts per token, E experts, hidden H, intermediate I):
    x             [T, H] fp32/bf16/fp16, unit stride inside a row
    topk_weights  [T, k] fp32 (the routers' dtype) or x's dtype
    topk_ids      [T, k] int32/int64, ids in [0, E)
    gate_up_proj  [E, 2I, H] x's dtype: gate rows [0, I), up rows [I, 2I)
    down_proj     [E, H, I] x's dtype
    out           [T, H] x's dtype
FP8 experts (DeepSeek-V2/V3 block FP8, atom/models/quantization/experts.py): both weights
float8_e4m3fn with ``Fp8Scales`` (float32, one per block of rows x cols); the kernels load
the fp8 tile and dequantize it to x's dtype (``dequantize_fp8_reference(...).to(x.dtype)``
element for element) before tl.dot, so the weights are read once, in FP8.

    out[t] = sum_j topk_weights[t, j] * down[e] @ act(gate_up[e] @ x[t]),  e = topk_ids[t, j]
    act(gate | up) = SiLU(gate) * up; with swiglu_limit L (DeepSeek-V4) gate is clamped to
    at most L and up to [-L, L] first. SiLU only: a config with another `hidden_act` is
    refused at load (atom/models/registry.py).

The fused path (``fused_moe``, vLLM fused_moe style, no host sync, CUDA-graph capturable):
1. ``_moe_align_kernel`` (one program): pair p = t * k + j goes to its expert's segment of
   ``sorted_pairs``; every segment is padded to a multiple of BLOCK_M with the value
   ``num_pairs`` (no pair), so each BLOCK_M block of rows belongs to one expert
   (``block_experts``, -1 past the used rows, whose count is ``num_padded``). Buffers have
   fixed sizes for a given T: at most ``T * k + E * (BLOCK_M - 1)`` rows. Its one-hot
   [pairs, E] steps follow T * k and the used blocks; the rows past them are a plain fill.
2. ``_moe_gate_up_kernel``: per (row block, column tile) gathers the block's x rows, runs
   both the gate and the up GEMM against its expert's weights and writes act(gate | up) in
   x's dtype, [T * k, I] by pair.
3. ``_moe_down_kernel``: the down GEMM of those rows times the routing weight, [T * k, H].
   With ``weight_before_down`` (DeepSeek-V4.1's order) step 2 multiplies its activation by
   the routing weight (rounded to x's dtype) and step 3 only runs the GEMM.
4. The sum over k (torch), or with a shared expert's output ``moe_combine``: the sum, the
   shared expert's gate and the add in one launch.
With few pairs (decode, ``use_decode_gemv``) steps 1-3 are instead one GEMV per pair and
column tile, which reads its expert id from ``topk_ids`` (atom/kernels/moe_gemv.py; weights
in x's dtype only: FP8 experts keep steps 1-3).
Work is proportional to T * k (plus at most BLOCK_M - 1 padding rows per expert); blocks
past ``num_padded`` exit at once. Runtime lengths: ``num_pairs`` (do_not_specialize), the
grid. Geometry (constexpr): H, I, E, k, tiles. Weight offsets are int64 (E * 2I * H passes
2^31 for DeepSeek-V3).

Numerics: the reference follows HF transformers' expert loop (DeepseekV2Experts,
DeepseekV4Experts): GEMMs in x's dtype, the product with the routing weight in the weight's
dtype rounded to x's dtype, the per-token sum in x's dtype in ascending expert order. The
kernels accumulate in fp32 and round where HF rounds (GEMM outputs, SiLU, products), but
sum the k contributions in fp32 and round once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from atom.kernels import moe_gemv
from atom.kernels.fp8_linear import FP8_DTYPE, dequantize_fp8_reference, fp8_capable
from atom.kernels.moe_combine import add_shared, moe_combine
from atom.kernels.platform import dot_precision, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


# -- alignment: pairs sorted by expert, padded to BLOCK_M per expert ---------------------------


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_align_kernel(
    topk_ids_ptr,  # [num_pairs] expert of pair p = t * k + j
    sorted_pairs_ptr,  # out [max_padded] int32: pairs by expert, padding = num_pairs
    block_experts_ptr,  # out [max_blocks] int32: expert of each BLOCK_M rows, -1 past the end
    num_padded_ptr,  # out [1] int32: rows in use (a multiple of BLOCK_M)
    num_pairs,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_P2: tl.constexpr,  # next_power_of_2(NUM_EXPERTS)
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,  # pairs (blocks) per iteration of a [BLOCK, EXPERTS_P2] step
    BLOCK_FILL: tl.constexpr,  # rows (blocks) per iteration past the used rows
):
    # One program; every phase reads only its inputs (no phase reads another's stores) and
    # writes rows no other phase writes. Work follows the pairs (and their used blocks), not
    # the E * (BLOCK_M - 1) rows of worst-case padding: those are a plain fill.
    experts = tl.arange(0, EXPERTS_P2)
    real_expert = (experts < NUM_EXPERTS)[None, :]
    max_padded = num_pairs + NUM_EXPERTS * (BLOCK_M - 1)
    max_blocks = (max_padded + BLOCK_M - 1) // BLOCK_M

    counts = tl.zeros((EXPERTS_P2,), dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        pairs = start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        hit = (ids[:, None] == experts[None, :]) & real_expert
        counts += tl.sum(hit.to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    pair_ends = starts + counts
    total = tl.sum(padded, axis=0)
    used_blocks = total // BLOCK_M
    tl.store(num_padded_ptr, total)

    # a used block's expert: how many segments end at or before its first row; its rows at
    # or past that expert's last pair hold no pair
    offs_m = tl.arange(0, BLOCK_M)
    for start in range(0, used_blocks, BLOCK):
        blocks = start + tl.arange(0, BLOCK)
        in_use = blocks < used_blocks
        first_row = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, expert, mask=in_use)
        own = experts[None, :] == expert[:, None]
        pair_end = tl.sum(tl.where(own, pair_ends[None, :], 0), axis=1)
        rows = first_row[:, None] + offs_m[None, :]
        padding = tl.full((BLOCK, BLOCK_M), 0, tl.int32) + num_pairs
        tl.store(
            sorted_pairs_ptr + rows, padding, mask=in_use[:, None] & (rows >= pair_end[:, None])
        )

    # past the used rows: no pair, no expert
    for start in range(total, max_padded, BLOCK_FILL):
        rows = start + tl.arange(0, BLOCK_FILL)
        padding = tl.full((BLOCK_FILL,), 0, tl.int32) + num_pairs
        tl.store(sorted_pairs_ptr + rows, padding, mask=rows < max_padded)
    for start in range(used_blocks, max_blocks, BLOCK_FILL):
        blocks = start + tl.arange(0, BLOCK_FILL)
        tl.store(
            block_experts_ptr + blocks,
            tl.full((BLOCK_FILL,), -1, tl.int32),
            mask=blocks < max_blocks,
        )

    # a pair's row: its expert's start + how many earlier pairs chose that expert
    seen = tl.zeros((EXPERTS_P2,), dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        pairs = start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        hit = (ids[:, None] == experts[None, :]) & real_expert
        hits = hit.to(tl.int32)
        rank = tl.cumsum(hits, axis=0) - 1 + seen[None, :]
        row = tl.sum(tl.where(hit, starts[None, :] + rank, 0), axis=1)
        tl.store(sorted_pairs_ptr + row, pairs, mask=tl.sum(hits, axis=1) > 0)
        seen += tl.sum(hits, axis=0)


# The align kernel's geometry (one-hot [pairs, experts] entries per step, warps) by pair
# count. `benchmarks.kernels --only-moe-align`, H200, device us a call (16384 / 16 was the
# geometry before): 10 pairs of 64 experts (Qwen3-Next batch 1) 3.53 at 1024 / 8 against
# 12.36 at 16384 / 8 and 15.02 at 16384 / 16; 6 of 16 (V4 batch 1) 3.12 against 9.05 /
# 9.71; but 640 pairs of 64 (Qwen3-Next batch 64) 45.57 at 1024 / 8 against 23.71 at
# 16384 / 8 (32.59 at 16384 / 16), and 384 of 16 8.37 against 9.22 (9.90). Two variants,
# as the grouped GEMMs' tiles (`default_tiles`) change with the pairs too.
ALIGN_SMALL_PAIRS = 128
ALIGN_SMALL = (1024, 8)
ALIGN_LARGE = (16384, 8)
ALIGN_OVERRIDE: tuple[int, int] | None = None  # a fixed (one_hot, warps): benchmarks' A/B


def align_geometry(num_pairs: int) -> tuple[int, int]:
    """(one-hot entries per step, warps) of the align kernel for `num_pairs` pairs."""
    if ALIGN_OVERRIDE is not None:
        return ALIGN_OVERRIDE
    return ALIGN_SMALL if num_pairs <= ALIGN_SMALL_PAIRS else ALIGN_LARGE


def moe_align_size(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(rows, blocks) of the alignment buffers: fixed for a given number of pairs."""
    max_padded = num_pairs + num_experts * (block_m - 1)
    return max_padded, -(-max_padded // block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_pairs [max_padded] int32, block_experts [max_blocks] int32, num_padded [1]
    int32) of ``topk_ids`` [T, k] on its device, without a host sync (see the module doc)."""
    if not use_triton(topk_ids):
        return moe_align_reference(topk_ids, num_experts, block_m)
    ids = topk_ids.reshape(-1)  # a view of torch.topk's contiguous output
    num_pairs = ids.numel()
    max_padded, max_blocks = moe_align_size(num_pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    experts_p2 = triton.next_power_of_2(num_experts)
    one_hot, warps = align_geometry(num_pairs)
    _moe_align_kernel[(1,)](
        ids,
        sorted_pairs,
        block_experts,
        num_padded,
        num_pairs,
        NUM_EXPERTS=num_experts,
        EXPERTS_P2=experts_p2,
        BLOCK_M=block_m,
        BLOCK=max(16, min(512, one_hot // experts_p2)),  # one-hot entries per step
        BLOCK_FILL=4096,
        num_warps=warps,
    )
    return sorted_pairs, block_experts, num_padded


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Pure-torch ``moe_align`` (same buffers, same values)."""
    ids = topk_ids.reshape(-1).long()
    num_pairs = ids.numel()
    max_padded, max_blocks = moe_align_size(num_pairs, num_experts, block_m)
    counts = torch.bincount(ids, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(ids, stable=True)
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[ids[order]]
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[(ends - padded)[ids[order]] + rank] = order.to(torch.int32)
    first_rows = torch.arange(max_blocks, device=ids.device) * block_m
    block_experts = torch.searchsorted(ends, first_rows, right=True)
    block_experts = torch.where(first_rows < ends[-1], block_experts, -1).to(torch.int32)
    return sorted_pairs, block_experts, ends[-1:].to(torch.int32)


# -- the grouped GEMMs ---------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(
    x_ptr,  # [T, H]
    gate_up_ptr,  # [E, 2I, H] x's dtype, or fp8 e4m3 with FP8_WEIGHT
    scale_ptr,  # FP8_WEIGHT: float32 [E, ceil(2I / SCALE_ROWS), ceil(H / SCALE_COLS)]
    out_ptr,  # [T * k, I] act(gate | up) by pair
    topk_weights_ptr,  # [T * k], read with WEIGHT_FIRST
    sorted_pairs_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_pairs,
    swiglu_limit,
    stride_x,
    stride_gate_up_expert,
    stride_gate_up_row,
    stride_out,
    stride_scale_expert,
    stride_scale_row,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,  # act * routing weight (then rounded), for the down GEMM
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no tf32), else "tf32" (unused for bf16)
    FP8_WEIGHT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,  # weight rows per scale
    SCALE_COLS: tl.constexpr,  # weight columns per scale: a multiple of BLOCK_K, or >= H
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program (m, n): rows [m * BLOCK_M, ...) of sorted_pairs (one expert), out columns
    # [n * BLOCK_N, ...) of both the gate and the up half.
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    is_pair = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTERMEDIATE
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_x
    gate_rows = (
        gate_up_ptr
        + expert * stride_gate_up_expert
        + offs_n.to(tl.int64)[None, :] * stride_gate_up_row
    )
    up_rows = gate_rows + INTERMEDIATE * stride_gate_up_row
    if FP8_WEIGHT:
        # each chunk of BLOCK_K columns lies in one scale column: one scale per weight row
        scales = scale_ptr + expert * stride_scale_expert
        gate_scales = scales + (offs_n // SCALE_ROWS).to(tl.int64) * stride_scale_row
        up_scales = scales + ((INTERMEDIATE + offs_n) // SCALE_ROWS).to(tl.int64) * stride_scale_row

    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < HIDDEN
        a = tl.load(x_rows + k[None, :], mask=is_pair[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(gate_rows + k[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(up_rows + k[:, None], mask=w_mask, other=0.0)
        if FP8_WEIGHT:  # dequantized to x's dtype as the reference does, then the same dot
            gate_scale = tl.load(gate_scales + k0 // SCALE_COLS, mask=n_mask, other=0.0)
            up_scale = tl.load(up_scales + k0 // SCALE_COLS, mask=n_mask, other=0.0)
            w_gate = (w_gate.to(tl.float32) * gate_scale[None, :]).to(a.dtype)
            w_up = (w_up.to(tl.float32) * up_scale[None, :]).to(a.dtype)
        acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)

    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)  # rounded like the GEMM's output in torch
    up = acc_up.to(dtype).to(tl.float32)
    if HAS_LIMIT:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    act = silu * up
    if WEIGHT_FIRST:
        weight = tl.load(topk_weights_ptr + pairs, mask=is_pair, other=0.0).to(tl.float32)
        act = act.to(dtype).to(tl.float32) * weight[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, act.to(dtype), mask=is_pair[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(
    hidden_ptr,  # [T * k, I] by pair
    down_ptr,  # [E, H, I] x's dtype, or fp8 e4m3 with FP8_WEIGHT
    scale_ptr,  # FP8_WEIGHT: float32 [E, ceil(H / SCALE_ROWS), ceil(I / SCALE_COLS)]
    topk_weights_ptr,  # [T * k]
    out_ptr,  # [T * k, H] by pair, times its routing weight
    sorted_pairs_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_pairs,
    stride_hidden,
    stride_down_expert,
    stride_down_row,
    stride_out,
    stride_scale_expert,
    stride_scale_row,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,  # the gate/up kernel applied the routing weight already
    DOT_PRECISION: tl.constexpr,
    FP8_WEIGHT: tl.constexpr,
    SCALE_ROWS: tl.constexpr,  # weight rows per scale
    SCALE_COLS: tl.constexpr,  # weight columns per scale: a multiple of BLOCK_K, or >= I
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program (m, n): rows [m * BLOCK_M, ...) of sorted_pairs, out columns [n * BLOCK_N, ...).
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    is_pair = pairs < num_pairs
    pair_rows = pairs.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    hidden_rows = hidden_ptr + pair_rows[:, None] * stride_hidden
    down_rows = (
        down_ptr + expert * stride_down_expert + offs_n.to(tl.int64)[None, :] * stride_down_row
    )
    if FP8_WEIGHT:
        row_scales = (
            scale_ptr
            + expert * stride_scale_expert
            + (offs_n // SCALE_ROWS).to(tl.int64) * stride_scale_row
        )

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTERMEDIATE, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < INTERMEDIATE
        a = tl.load(hidden_rows + k[None, :], mask=is_pair[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(down_rows + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP8_WEIGHT:
            scale = tl.load(row_scales + k0 // SCALE_COLS, mask=n_mask, other=0.0)
            w = (w.to(tl.float32) * scale[None, :]).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)

    dtype = out_ptr.dtype.element_ty
    y = acc
    if not WEIGHT_FIRST:
        weight = tl.load(topk_weights_ptr + pairs, mask=is_pair, other=0.0).to(tl.float32)
        y = acc.to(dtype).to(tl.float32) * weight[:, None]
    out = out_ptr + pair_rows[:, None] * stride_out + offs_n[None, :]
    tl.store(out, y.to(dtype), mask=is_pair[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class MoeTiles:
    """Tile geometry of the grouped GEMMs (constexpr: one compiled variant each)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def default_tiles(num_pairs: int, num_experts: int) -> MoeTiles:
    """Rows per block from the pairs an expert gets on average: 16 for decode batches
    (weight-bandwidth bound, little padding), larger for prefill (reuse of weight tiles)."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return MoeTiles(16, 64, 128)
    if per_expert <= 64:
        return MoeTiles(32, 64, 64)
    return MoeTiles(64, 128, 64, num_warps=8)


@dataclass(frozen=True)
class Fp8Scales:
    """float32 scales of FP8 e4m3 experts: weight = fp8 * scale, one scale per block of
    (rows, cols) = ``*_block``, ragged at the edges (atom/models/quantization/experts.py)."""

    gate_up: torch.Tensor  # [E, ceil(2I / rows), ceil(H / cols)]
    down: torch.Tensor  # [E, ceil(H / rows), ceil(I / cols)]
    gate_up_block: tuple[int, int]
    down_block: tuple[int, int]

    def dequantize(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, dtype):
        """(gate_up [E, 2I, H], down [E, H, I]) in ``dtype``: what the reference runs."""
        gate_up = dequantize_fp8_reference(gate_up_proj, self.gate_up, self.gate_up_block)
        down = dequantize_fp8_reference(down_proj, self.down, self.down_block)
        return gate_up.to(dtype), down.to(dtype)


def fp8_block_k(block_k: int, cols_per_scale: int, cols: int) -> int | None:
    """The largest BLOCK_K <= ``block_k`` (a power of 2, at least 16) whose chunks of a row
    of ``cols`` each lie inside one scale column; None where there is none."""
    if cols_per_scale >= cols:
        return block_k
    while block_k >= 16 and cols_per_scale % block_k:
        block_k //= 2
    return block_k if block_k >= 16 else None


def _scale_args(weight: torch.Tensor, scale: torch.Tensor | None, block):
    """(scale, its expert and row strides, block) of one grouped GEMM's launch; without a
    scale the weight and zeros, which FP8_WEIGHT=False compiles out of the kernel."""
    if scale is None:
        return weight, 0, 0, (1, 1)
    experts, rows, cols = weight.shape
    assert scale.shape == (experts, -(-rows // block[0]), -(-cols // block[1])), scale.shape
    assert scale.dtype == torch.float32 and scale.stride(2) == 1, (scale.dtype, scale.stride())
    return scale, scale.stride(0), scale.stride(1), block


def _grouped_pairs(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    swiglu_limit: float | None,
    weight_before_down: bool,
    tiles: MoeTiles,
    fp8_scales: Fp8Scales | None = None,
) -> torch.Tensor:
    """[T * k, H] by pair, times its routing weight: align, then the two grouped GEMMs
    (with ``fp8_scales``, on the FP8 weights; see ``fused_moe``)."""
    num_tokens, hidden = x.shape
    num_experts, intermediate = down_proj.shape[0], down_proj.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    gate_up_k = min(tiles.block_k, max(16, triton.next_power_of_2(hidden)))
    down_k = min(tiles.block_k, max(16, triton.next_power_of_2(intermediate)))
    if fp8_scales is not None:
        fp8_gate_up_k = fp8_block_k(gate_up_k, fp8_scales.gate_up_block[1], hidden)
        fp8_down_k = fp8_block_k(down_k, fp8_scales.down_block[1], intermediate)
        if fp8_gate_up_k and fp8_down_k and (not x.is_cuda or fp8_capable(x.device)):
            gate_up_k, down_k = fp8_gate_up_k, fp8_down_k
        else:
            gate_up_proj, down_proj = fp8_scales.dequantize(gate_up_proj, down_proj, x.dtype)
            fp8_scales = None
    if fp8_scales is None:
        gate_up_scale, *gate_up_strides, gate_up_block = _scale_args(gate_up_proj, None, None)
        down_scale, *down_strides, down_block = _scale_args(down_proj, None, None)
    else:
        gate_up_scale, *gate_up_strides, gate_up_block = _scale_args(
            gate_up_proj, fp8_scales.gate_up, fp8_scales.gate_up_block
        )
        down_scale, *down_strides, down_block = _scale_args(
            down_proj, fp8_scales.down, fp8_scales.down_block
        )
    sorted_pairs, block_experts, num_padded = moe_align(topk_ids, num_experts, tiles.block_m)
    num_blocks = block_experts.numel()
    precision = dot_precision(x.dtype)
    launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)

    hidden_states = torch.empty(num_pairs, intermediate, dtype=x.dtype, device=x.device)
    block_n = min(tiles.block_n, max(16, triton.next_power_of_2(intermediate)))
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(intermediate, block_n))](
        x,
        gate_up_proj,
        gate_up_scale,
        hidden_states,
        topk_weights.reshape(-1),
        sorted_pairs,
        block_experts,
        num_padded,
        num_pairs,
        0.0 if swiglu_limit is None else float(swiglu_limit),
        x.stride(0),
        gate_up_proj.stride(0),
        gate_up_proj.stride(1),
        hidden_states.stride(0),
        *gate_up_strides,
        HIDDEN=hidden,
        INTERMEDIATE=intermediate,
        TOP_K=top_k,
        HAS_LIMIT=swiglu_limit is not None,
        WEIGHT_FIRST=weight_before_down,
        DOT_PRECISION=precision,
        FP8_WEIGHT=fp8_scales is not None,
        SCALE_ROWS=gate_up_block[0],
        SCALE_COLS=gate_up_block[1],
        BLOCK_M=tiles.block_m,
        BLOCK_N=block_n,
        BLOCK_K=gate_up_k,
        **launch,
    )
    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    block_n = min(tiles.block_n, max(16, triton.next_power_of_2(hidden)))
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        hidden_states,
        down_proj,
        down_scale,
        topk_weights.reshape(-1),
        per_pair,
        sorted_pairs,
        block_experts,
        num_padded,
        num_pairs,
        hidden_states.stride(0),
        down_proj.stride(0),
        down_proj.stride(1),
        per_pair.stride(0),
        *down_strides,
        HIDDEN=hidden,
        INTERMEDIATE=intermediate,
        WEIGHT_FIRST=weight_before_down,
        DOT_PRECISION=precision,
        FP8_WEIGHT=fp8_scales is not None,
        SCALE_ROWS=down_block[0],
        SCALE_COLS=down_block[1],
        BLOCK_M=tiles.block_m,
        BLOCK_N=block_n,
        BLOCK_K=down_k,
        **launch,
    )
    return per_pair


# Decode's choice: at most min(DECODE_GEMV_MAX_PAIRS, experts) (token, k) pairs run one GEMV
# per pair (moe_gemv.py: no align, no rows padded to BLOCK_M), more the grouped GEMMs (an
# expert's weight tiles reused across its rows). H200, `benchmarks.kernels --only-moe-gemv`
# (L2-cold): per-pair GEMVs won at Qwen3-Next's 64 experts up to 6 tokens of top-10 (60
# pairs: 1.05x, 1.04-1.33x below), and at DeepSeek-V4's 16 experts at 1-2 tokens of top-6
# (6-12 pairs, 1.03-1.14x) but lost at 4 and 6 tokens (24-36 pairs: 0.91x, 0.75x), where
# pairs repeat experts: so no more pairs than experts.
DECODE_GEMV_MAX_PAIRS = 64
DECODE_GEMV_OVERRIDE: bool | None = None  # True / False: that path at every pair count (A/B)
# The per-pair GEMV runs a shared expert whose math is a routed expert's as one more pair a
# token (``SharedExpert.weights``): its own GEMV launches saved. False: always its forward (A/B).
SHARED_PAIR = True


@dataclass(frozen=True)
class SharedExpert:
    """A shared expert: ``forward(x)`` its output [T, H]; ``weights`` (gate [I, H], up [I, H],
    down [H, I]) where it computes what a routed expert would with them (SwiGLU, the same
    limit), which lets the per-pair decode GEMV run it as one more pair (weight 1) when
    ``moe_gemv.fits_shared``; None: always ``forward``."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    weights: moe_gemv.SharedWeights | None = None


def use_decode_gemv(num_pairs: int, num_experts: int) -> bool:
    """Whether ``fused_moe`` runs ``num_pairs`` (token, k) pairs over ``num_experts``
    experts as one GEMV per pair."""
    if DECODE_GEMV_OVERRIDE is not None:
        return DECODE_GEMV_OVERRIDE
    return num_pairs <= min(DECODE_GEMV_MAX_PAIRS, num_experts)


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    swiglu_limit: float | None = None,
    tiles: MoeTiles | None = None,
    weight_before_down: bool = False,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    fp8_scales: Fp8Scales | None = None,
    shared_expert: SharedExpert | None = None,
) -> torch.Tensor:
    """Routed experts through the Triton kernels on CUDA (or under TRITON_INTERPRET=1), the
    torch reference otherwise. No host sync; fixed buffer sizes for a given T. With
    ``shared`` [T, H] (a shared expert's output) the result is ``routed + shared``, or
    ``routed + sigmoid(x @ shared_gate.T) * shared`` with ``shared_gate`` [1, H]: the sum
    over k and that epilogue in one launch (atom/kernels/moe_combine.py). Few pairs
    (``use_decode_gemv``) run one GEMV per pair (atom/kernels/moe_gemv.py), more the
    grouped GEMMs; given ``tiles`` (the grouped GEMMs'), always the grouped GEMMs.
    ``shared_expert`` (instead of ``shared``): the per-pair GEMV runs it as one more pair a
    token where its weights fit (``SHARED_PAIR``), else its forward gives ``shared``.

    ``fp8_scales``: the weights are float8_e4m3fn and the grouped GEMMs dequantize each tile
    as they read it, at every pair count (the per-pair GEMV reads x's dtype only). The
    reference dequantizes every expert first; so do the kernels where a scale block's
    columns hold no power-of-2 chunk of 16 or more, or on a GPU without e4m3 conversions."""
    assert shared is None or shared_expert is None, "shared or shared_expert, not both"
    if not use_triton(x):
        if fp8_scales is not None:
            gate_up_proj, down_proj = fp8_scales.dequantize(gate_up_proj, down_proj, x.dtype)
        routed = routed_experts_reference(
            x, topk_weights, topk_ids, gate_up_proj, down_proj, swiglu_limit, weight_before_down
        )
        if shared_expert is not None:
            shared = shared_expert.forward(x)
        return routed if shared is None else add_shared(routed, shared, x, shared_gate)
    num_tokens, hidden = x.shape
    num_experts, two_intermediate, _ = gate_up_proj.shape
    intermediate = two_intermediate // 2
    top_k = topk_ids.shape[1]
    assert gate_up_proj.shape == (num_experts, 2 * intermediate, hidden), gate_up_proj.shape
    assert down_proj.shape == (num_experts, hidden, intermediate), down_proj.shape
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k)
    assert x.stride(1) == gate_up_proj.stride(2) == down_proj.stride(2) == 1
    weight_dtype = x.dtype if fp8_scales is None else FP8_DTYPE
    assert gate_up_proj.dtype == down_proj.dtype == weight_dtype
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_pairs = num_tokens * top_k
    args = (x, topk_weights, topk_ids, gate_up_proj, down_proj, swiglu_limit, weight_before_down)
    if tiles is None and fp8_scales is None and use_decode_gemv(num_pairs, num_experts):
        weights = None if shared_expert is None else shared_expert.weights
        if SHARED_PAIR and weights is not None and moe_gemv.fits_shared(weights, x, gate_up_proj):
            # [T, k + 1, H]: each token's k routed rows, then its shared expert's
            per_pair = moe_gemv.routed_pairs(*args, shared=weights)
            per_pair = per_pair.view(num_tokens, top_k + 1, hidden)
            return moe_combine(per_pair[:, :top_k], per_pair[:, top_k], x, shared_gate)
        per_pair = moe_gemv.routed_pairs(*args)
    else:
        tiles = tiles or default_tiles(num_pairs, num_experts)
        per_pair = _grouped_pairs(*args, tiles, fp8_scales)
    if shared_expert is not None:
        shared = shared_expert.forward(x)
    if shared is not None:
        return moe_combine(per_pair.view(num_tokens, top_k, hidden), shared, x, shared_gate)
    if top_k == 1:
        return per_pair
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)


# -- the torch reference -------------------------------------------------------------------------


def swiglu_reference(gate_up: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """[..., 2I] (gate | up) -> SiLU(gate) * up, gate clamped to <= L and up to [-L, L]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.silu(gate) * up


def routed_experts_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    swiglu_limit: float | None = None,
    weight_before_down: bool = False,
) -> torch.Tensor:
    """Pure-torch routed experts: the (token, k) pairs sorted by expert, one GEMM pair per
    expert segment (work proportional to T * k). Reads the segment sizes on the host, so it
    is not CUDA-graph capturable; ``fused_moe`` is. ``weight_before_down``: the weight
    multiplies the activation (rounded to x's dtype) instead of the down GEMM's output."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    # Pairs in choice-major order (choice j of every token, then choice j + 1), sorted
    # stably by expert: inside an expert, by choice then token, the rows HF's expert loop
    # hands each GEMM (torch.where over its [top_k, T] mask). The same rows in the same
    # order keep the results bit-identical under a multi-threaded GEMM too.
    flat_ids = topk_ids.t().reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    tokens = order % num_tokens
    weights = topk_weights.t().reshape(-1)[order, None]
    counts = torch.bincount(flat_ids, minlength=gate_up_proj.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        hidden = swiglu_reference(F.linear(x[tokens[rows]], gate_up_proj[expert]), swiglu_limit)
        if weight_before_down:
            y = F.linear((hidden * weights[rows]).to(x.dtype), down_proj[expert])
        else:
            y = F.linear(hidden, down_proj[expert]) * weights[rows]
        # one add per expert, in expert order, like HF (one index_add_ over all the pairs
        # rounds a bf16 sum differently)
        out.index_add_(0, tokens[rows], y.to(x.dtype))
        start += count
    return out

"""Routed experts at decode: one GEMV per (token, k) pair, no sort by expert.

Shapes and dtypes as atom/kernels/moe.py (T tokens, k experts per token, E experts, hidden
H, intermediate I):
    x             [T, H] fp32/bf16/fp16, unit stride inside a row
    topk_weights  [T * k] fp32 or x's dtype, contiguous
    topk_ids      [T * k] int32/int64, contiguous: pair p = t * k + j
    gate_up_proj  [E, 2I, H], down_proj [E, H, I], x's dtype, unit stride inside a row
    hidden        [T * k, I] act(gate | up) by pair (x's dtype)
    per_pair      [T * k, H] by pair, times its routing weight (x's dtype)

Why: with few pairs (batch-1 decode: 10 of Qwen3-Next's 64 experts, 6 of V4's 16) the
grouped GEMMs of moe.py pad every expert's rows to BLOCK_M = 16 for tl.dot and launch
``(pairs + E * 15) / 16`` row blocks of which only ``pairs`` hold work, after the align
kernel. Here program (pair, n) reads its expert id from ``topk_ids`` and streams
[BLOCK_N, BLOCK_K] tiles of that expert's weight rows (contiguous along K: coalesced),
times the pair's input row loaded once per chunk as [1, BLOCK_K] and broadcast over the
tile; an fp32 [BLOCK_N, BLOCK_K] accumulator is summed along K once at the end, as
atom/kernels/gemv.py's ``_gemv_row_kernel``. A pair whose expert another pair also chose
reads the same weight again (from L2 when they run together): at many pairs the grouped
GEMMs win, hence ``moe.use_decode_gemv``'s pair threshold.

Rounding is the grouped kernels' (``_moe_gate_up_kernel`` / ``_moe_down_kernel``): GEMM
outputs, SiLU and products rounded to x's dtype where HF rounds; the sum over k and the
shared expert stay in moe.py's epilogue. The torch reference is
``moe.routed_experts_reference`` (the sum over k of these rows).

Runtime lengths: none reach the kernels (the pair count is the grid's first axis).
Geometry (constexpr): H, I, k, the flags and the tiles (``MoeGemvTiles``, from the shape
only: ``gemv_tiles``, or ``TILES_OVERRIDE`` for a benchmark's A/B). Weight offsets int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


@triton.jit
def _moe_gate_up_gemv_kernel(
    x_ptr,  # [T, H]
    gate_up_ptr,  # [E, 2I, H]
    out_ptr,  # out [T * k, I] act(gate | up) by pair
    topk_ids_ptr,  # [T * k]
    topk_weights_ptr,  # [T * k], read with WEIGHT_FIRST
    shared_gate_ptr,  # SHARED: the shared expert's gate rows [I, H] (its own row stride)
    shared_up_ptr,  # SHARED: its up rows [I, H]
    swiglu_limit,
    stride_x,
    stride_gate_up_expert,
    stride_gate_up_row,
    stride_out,
    stride_shared_row,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,  # one more pair per token: the shared expert (weight 1)
    HAS_LIMIT: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,  # act * routing weight (then rounded), for the down GEMV
    BLOCK_N: tl.constexpr,  # out columns per program, of both the gate and the up half
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # > 1: the K loop's loads pipelined through shared memory
):
    # Program (pair, n): out columns [n * BLOCK_N, ...) of pair p = t * k + j, or with
    # SHARED p = t * (k + 1) + j, j == k the shared expert.
    pair = tl.program_id(0).to(tl.int64)
    token, routed, is_shared = _pair(pair, TOP_K, SHARED)
    expert = tl.load(topk_ids_ptr + routed, mask=is_shared == 0, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTERMEDIATE
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + token * stride_x
    rows = offs_n.to(tl.int64)[:, None]
    gate_rows = gate_up_ptr + expert * stride_gate_up_expert + rows * stride_gate_up_row
    up_rows = gate_rows + INTERMEDIATE * stride_gate_up_row
    if SHARED:
        if is_shared:
            gate_rows = shared_gate_ptr + rows * stride_shared_row
            up_rows = shared_up_ptr + rows * stride_shared_row

    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, HIDDEN, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        k_mask = k < HIDDEN
        a = tl.load(x_row + k[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
        w_mask = n_mask[:, None] & k_mask[None, :]
        w_gate = tl.load(gate_rows + k[None, :], mask=w_mask, other=0.0)
        w_up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
        acc_gate += w_gate.to(tl.float32) * a
        acc_up += w_up.to(tl.float32) * a

    dtype = out_ptr.dtype.element_ty
    gate = tl.sum(acc_gate, axis=1).to(dtype).to(tl.float32)  # rounded like F.linear's
    up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
    if HAS_LIMIT:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    act = silu * up
    if WEIGHT_FIRST:  # the shared expert's weight is 1: its act rounded once, as unweighted
        weight = tl.load(topk_weights_ptr + routed, mask=is_shared == 0, other=1.0)
        act = act.to(dtype).to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + pair * stride_out + offs_n, act.to(dtype), mask=n_mask)


@triton.jit
def _pair(pair, TOP_K: tl.constexpr, SHARED: tl.constexpr):
    """(token, index into topk_ids / topk_weights, whether the pair is the shared expert)."""
    if SHARED:
        token = pair // (TOP_K + 1)
        j = pair % (TOP_K + 1)
        return token, token * TOP_K + j, j == TOP_K
    return pair // TOP_K, pair, pair < 0


@triton.jit
def _moe_down_gemv_kernel(
    hidden_ptr,  # [T * k, I] by pair
    down_ptr,  # [E, H, I]
    out_ptr,  # out [T * k, H] by pair, times its routing weight
    topk_ids_ptr,  # [T * k]
    topk_weights_ptr,  # [T * k]
    shared_down_ptr,  # SHARED: the shared expert's down rows [H, I]
    stride_hidden,
    stride_down_expert,
    stride_down_row,
    stride_out,
    stride_shared_row,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,  # the gate/up kernel applied the routing weight already
    BLOCK_N: tl.constexpr,  # out columns (rows of down) per program
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Program (pair, n): out columns [n * BLOCK_N, ...) of pair p.
    pair = tl.program_id(0).to(tl.int64)
    _, routed, is_shared = _pair(pair, TOP_K, SHARED)
    expert = tl.load(topk_ids_ptr + routed, mask=is_shared == 0, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    hidden_row = hidden_ptr + pair * stride_hidden
    rows = offs_n.to(tl.int64)[:, None]
    down_rows = down_ptr + expert * stride_down_expert + rows * stride_down_row
    if SHARED:
        if is_shared:
            down_rows = shared_down_ptr + rows * stride_shared_row

    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, INTERMEDIATE, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        k_mask = k < INTERMEDIATE
        a = tl.load(hidden_row + k[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(down_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * a

    dtype = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=1)
    if not WEIGHT_FIRST:  # the shared expert's weight is 1 (its output rounded once)
        weight = tl.load(topk_weights_ptr + routed, mask=is_shared == 0, other=1.0)
        y = y.to(dtype).to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + pair * stride_out + offs_n, y.to(dtype), mask=n_mask)


@dataclass(frozen=True)
class MoeGemvTiles:
    """Launch geometry of one GEMV kernel (constexpr: one compiled variant each)."""

    block_n: int  # output columns per program (gate/up: of each half)
    block_k: int  # reduction elements per chunk of the K loop
    num_warps: int = 4
    num_stages: int = 1  # software-pipelining depth of the K loop


# (gate_up tiles, down tiles) fixed for every shape: a benchmark's A/B, None: `gemv_tiles`.
TILES_OVERRIDE: tuple[MoeGemvTiles, MoeGemvTiles] | None = None


def gemv_tiles(rows: int, reduction: int, weight_tiles: int = 1) -> MoeGemvTiles:
    """Tiles from the shape alone (``rows`` output columns of ``reduction`` elements each;
    ``weight_tiles``: tiles a chunk loads, 2 for the gate and up rows): 16 rows a program
    over the tiles of a chunk (8 for gate/up), chunks of 256, 4 warps, one stage (loads
    into registers). H200, `benchmarks.kernels --only-moe-gemv`, 26 tile pairs: these were
    the fastest (hot, and within 1.5% of the fastest L2-cold) at Qwen3-Next's (H 2048,
    I 512) and DeepSeek-V4's (H 4096, I 2048) shapes at 1 and 2 tokens (docs/benchmarks.md);
    wider chunks or 2 stages lost 1-25%. Fewer rows only where the layer has fewer."""
    block_n = min(16 // weight_tiles, max(1, triton.next_power_of_2(rows)))
    block_k = min(256, max(16, triton.next_power_of_2(reduction)))
    return MoeGemvTiles(block_n, block_k, 4, 1)


def routed_pairs(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    swiglu_limit: float | None = None,
    weight_before_down: bool = False,
    shared: SharedWeights | None = None,
) -> torch.Tensor:
    """[T * k, H] in x's dtype: row t * k + j is expert ``topk_ids[t, j]`` of x[t] times
    ``topk_weights[t, j]`` (two launches, no host sync). With ``shared`` (``fits_shared``)
    [T * (k + 1), H]: row t * (k + 1) + k is the shared expert of x[t] (weight 1, the same
    activation and rounding points as a routed expert). The caller (``moe.fused_moe``)
    checks the shapes and sums over k."""
    num_tokens, hidden = x.shape
    intermediate = down_proj.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * (top_k + (shared is not None))
    ids, weights = topk_ids.reshape(-1), topk_weights.reshape(-1)  # views of topk's outputs
    gate_up_tiles, down_tiles = TILES_OVERRIDE or (
        gemv_tiles(intermediate, hidden, weight_tiles=2),
        gemv_tiles(hidden, intermediate),
    )
    gate, up, down = (gate_up_proj, gate_up_proj, down_proj) if shared is None else shared

    hidden_states = torch.empty(num_pairs, intermediate, dtype=x.dtype, device=x.device)
    _moe_gate_up_gemv_kernel[(num_pairs, triton.cdiv(intermediate, gate_up_tiles.block_n))](
        x,
        gate_up_proj,
        hidden_states,
        ids,
        weights,
        gate,
        up,
        0.0 if swiglu_limit is None else float(swiglu_limit),
        x.stride(0),
        gate_up_proj.stride(0),
        gate_up_proj.stride(1),
        hidden_states.stride(0),
        gate.stride(-2),
        HIDDEN=hidden,
        INTERMEDIATE=intermediate,
        TOP_K=top_k,
        SHARED=shared is not None,
        HAS_LIMIT=swiglu_limit is not None,
        WEIGHT_FIRST=weight_before_down,
        BLOCK_N=gate_up_tiles.block_n,
        BLOCK_K=gate_up_tiles.block_k,
        NUM_STAGES=gate_up_tiles.num_stages,
        num_warps=gate_up_tiles.num_warps,
    )
    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _moe_down_gemv_kernel[(num_pairs, triton.cdiv(hidden, down_tiles.block_n))](
        hidden_states,
        down_proj,
        per_pair,
        ids,
        weights,
        down,
        hidden_states.stride(0),
        down_proj.stride(0),
        down_proj.stride(1),
        per_pair.stride(0),
        down.stride(-2),
        HIDDEN=hidden,
        INTERMEDIATE=intermediate,
        TOP_K=top_k,
        SHARED=shared is not None,
        WEIGHT_FIRST=weight_before_down,
        BLOCK_N=down_tiles.block_n,
        BLOCK_K=down_tiles.block_k,
        NUM_STAGES=down_tiles.num_stages,
        num_warps=down_tiles.num_warps,
    )
    return per_pair


SharedWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate [I, H], up, down [H, I]


def fits_shared(shared: SharedWeights, x: torch.Tensor, gate_up_proj: torch.Tensor) -> bool:
    """Whether ``routed_pairs`` can run a shared expert as one more pair: gate and up [I, H],
    down [H, I] with the routed experts' I and H, x's dtype, unit stride inside a row, and
    gate and up with one row stride."""
    gate, up, down = shared
    _, two_intermediate, hidden = gate_up_proj.shape
    rows = (two_intermediate // 2, hidden)
    return (
        tuple(gate.shape) == tuple(up.shape) == rows
        and tuple(down.shape) == rows[::-1]
        and gate.dtype == up.dtype == down.dtype == x.dtype
        and gate.stride(-1) == up.stride(-1) == down.stride(-1) == 1
        and gate.stride(-2) == up.stride(-2)
    )

"""DeepSeek-V4 attention: one softmax over window keys, compressed entries and a sink.

K = V (one shared head). Per query: the sliding window (ring of the sequence's state slot,
``[num_state_slots + 1, window, D]``, position p at row p % window), the compressed entries
it may see (paged pool, atom/kernels/v4_compressor.py) and a learned per-head sink logit
that takes probability mass but carries no value.

Triton kernels (each beside its torch reference below):
- `write_window`: ring[slot, position % window] = kv, one program per row; state slot -1
  (padding) writes the scratch slot. Runtime length: the number of rows (grid).
- `v4_decode_attention`: one program per (row, head block) walks the row's window ring,
  then its entries (each mapped to its pool row through the page-table row): the
  `num_entries` chosen ids (CSA's top-k, -1 = none) or, with no id list (HCA), every entry
  the row may see, ``(position + 1) // ratio`` of them (a loop bound read on the device:
  the cost follows the sequence, not `max_model_len`); an online softmax in fp32, the sink
  folded in at the end: one pass over window + entries + sink. At small batches the keys
  are split (flash-decoding): program (row, head block, split) takes an equal run of the
  row's key tiles (window first, then entries; the bounds read on the device), writes its
  running max, sum and unnormalised output, and `_v4_merge_kernel` folds the splits and
  the sink into one softmax. Runtime lengths: `num_entries`, the number of splits and the
  page-table row stride (do_not_specialize, the grid); geometry constexpr (head dim,
  window, ratio, block size).
  Offsets int64. Static shapes, no host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from atom.kernels.decode_attention import multi_processors, placeholder
from atom.kernels.platform import use_triton
from atom.kernels.v4_compressor import (
    entry_parts,
    gather_entries,
    pool_offsets,
    rows_per_block,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


def attend_with_sink(q, keys, valid, sinks, scale: float) -> torch.Tensor:
    """q ``[T, H, D]``, keys ``[T, L, D]`` (or ``[L, D]`` shared by every query), valid
    ``[T, L]`` bool, sinks ``[H]`` -> ``[T, H, D]``."""
    shared = keys.dim() == 2
    logits = torch.einsum("thd,ld->thl" if shared else "thd,tld->thl", q.float(), keys.float())
    logits = logits * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(dim=-1)[..., :-1]
    return torch.einsum("thl,ld->thd" if shared else "thl,tld->thd", probs.to(keys.dtype), keys)


def window_keys(ring, slots, positions, valid_rows):
    """Ring rows of each query's window: keys ``[B, W, D]`` and their validity."""
    size = ring.shape[1]
    j = torch.arange(size, device=ring.device)
    t = positions.long()[:, None]
    key_positions = t - ((t - j) % size)
    return ring[slots.long()], (key_positions >= 0) & valid_rows[:, None]


def write_window_reference(ring, kv, state_slots, positions) -> None:
    """ring[slot, position % W] = kv ``[B, D]``; state slot -1 (padding) writes scratch."""
    slots = torch.where(state_slots < 0, ring.shape[0] - 1, state_slots).long()
    ring[slots, positions.long() % ring.shape[1]] = kv.to(ring.dtype)


def v4_decode_attention_reference(
    q: torch.Tensor,
    ring: torch.Tensor,
    state_slots: torch.Tensor,
    positions: torch.Tensor,
    context_lens: torch.Tensor,
    pool: torch.Tensor | None,
    entry_ids: torch.Tensor | None,
    block_tables: torch.Tensor,
    ratio: int,
    block_size: int,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per row: window + entries ``entry_ids`` ``[B, N]`` (-1 = none) + sink;
    ``entry_ids=None`` with a pool: every entry the row may see, ``w < (position + 1) //
    ratio`` (HCA; the width is the batch's largest count, a host read).

    Padded rows (context length 0) attend to nothing and return zeros."""
    valid_rows = (context_lens > 0) & (state_slots >= 0)
    slots = torch.where(state_slots < 0, ring.shape[0] - 1, state_slots)
    keys, valid = window_keys(ring, slots, positions, valid_rows)
    if pool is not None:
        if entry_ids is None:  # every visible entry (HCA): as wide as the batch needs
            counts = ((positions.long() + 1) // ratio)[:, None]
            ids = torch.arange(int(counts.max()) if counts.numel() else 0, device=q.device)
            entry_ids = torch.where(ids[None, :] < counts, ids[None, :], -1)
        entries = gather_entries(pool, block_tables, entry_ids, ratio, block_size)
        keys = torch.cat([keys, entries.to(keys.dtype)], dim=1)
        valid = torch.cat([valid, (entry_ids >= 0) & valid_rows[:, None]], dim=1)
    return attend_with_sink(q, keys, valid, sinks, scale)


# -- Triton ------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_rows"])
def _write_window_kernel(
    ring_ptr,
    kv_ptr,
    slots_ptr,
    positions_ptr,
    num_rows,
    stride_kv_row,
    SCRATCH: tl.constexpr,
    WINDOW: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    if row < num_rows:
        offs_d = tl.arange(0, BLOCK_D)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        slot = tl.where(slot < 0, SCRATCH, slot)
        position = tl.load(positions_ptr + row).to(tl.int64)
        values = tl.load(kv_ptr + row * stride_kv_row + offs_d, mask=offs_d < DIM)
        dest = ring_ptr + (slot * WINDOW + position % WINDOW) * DIM + offs_d
        tl.store(dest, values.to(ring_ptr.dtype.element_ty), mask=offs_d < DIM)


def write_window(ring, kv, state_slots, positions) -> None:
    """Triton `write_window_reference` (ring ``[slots + 1, W, D]`` contiguous)."""
    if not use_triton(kv):
        write_window_reference(ring, kv, state_slots, positions)
        return
    assert ring.is_contiguous() and kv.stride(-1) == 1
    num_rows, dim = kv.shape
    if num_rows == 0:
        return
    _write_window_kernel[(num_rows,)](
        ring, kv, state_slots, positions, num_rows, kv.stride(0),
        SCRATCH=ring.shape[0] - 1, WINDOW=ring.shape[1], DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim),
    )  # fmt: skip


@triton.jit
def _online_update(q, keys, valid, m, denom, acc, scale):
    """Fold one tile of keys (= values) into the running max, sum and accumulator (fp32
    dots without tf32: "ieee"; bf16 inputs use the tensor cores either way)."""
    scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(keys.dtype), keys, input_precision="ieee")
    return m_new, denom, acc


@triton.jit(do_not_specialize=["num_entries", "stride_tables_row", "num_blocks", "stride_ids_row"])
def _v4_decode_kernel(
    q_ptr,
    ring_ptr,
    slots_ptr,
    positions_ptr,
    context_lens_ptr,
    pool_ptr,
    entry_ids_ptr,
    tables_ptr,
    sinks_ptr,
    out_ptr,
    partial_acc_ptr,  # [rows, NUM_HEADS, splits, DIM] fp32, used when split
    partial_stats_ptr,  # [rows, NUM_HEADS, splits, 2] fp32 (running max, sum), when split
    num_entries,
    stride_tables_row,
    num_blocks,
    scale,
    stride_q_row,
    stride_q_head,
    stride_out_row,
    stride_out_head,
    stride_ids_row,
    NUM_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    WINDOW: tl.constexpr,
    SCRATCH: tl.constexpr,
    RATIO: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS_PER_BLOCK: tl.constexpr,
    PART_WIDTH: tl.constexpr,  # channels per pool row: DIM, or a part of it (`pool_layout`)
    PARTS: tl.constexpr,
    HAS_ENTRIES: tl.constexpr,
    ALL_VISIBLE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask, dim_mask = heads < NUM_HEADS, offs_d < DIM
    slot = tl.load(slots_ptr + row).to(tl.int64)
    position = tl.load(positions_ptr + row).to(tl.int64)
    context_len = tl.load(context_lens_ptr + row)
    # a padded row (no state slot, or context length 0) attends to nothing (the interpreter
    # wants vector masks: `live` is broadcast before the comparison)
    live = tl.where(slot >= 0, context_len, 0)
    slot = tl.where(slot < 0, SCRATCH, slot)
    q_rows = q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_rows, mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # The row's keys as tiles of BLOCK_N: the window's, then its entries'; split `split`
    # of `num_splits` takes an equal run of them (runtime bounds: one variant).
    window_tiles: tl.constexpr = (WINDOW + BLOCK_N - 1) // BLOCK_N
    count = 0
    if HAS_ENTRIES:
        if ALL_VISIBLE:  # every entry the row may see: a loop bound from its own position
            count = tl.where(live > 0, (position + 1) // RATIO, 0)
        else:  # the row's chosen ids (a list of num_entries, -1 = none)
            count = num_entries
    tiles = window_tiles + tl.cdiv(count, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    first, last = split * per_split, tl.minimum((split + 1) * per_split, tiles)
    for tile in range(tl.minimum(first, window_tiles), tl.minimum(last, window_tiles)):
        # the window ring: row j holds position p % W == j
        j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_pos = position - ((position - j) % WINDOW + WINDOW) % WINDOW
        valid = (j < WINDOW) & (key_pos >= 0) & ((live + tl.zeros([BLOCK_N], tl.int64)) > 0)
        k_rows = ring_ptr + (slot * WINDOW + j)[:, None] * DIM + offs_d[None, :]
        keys = tl.load(k_rows, mask=valid[:, None] & dim_mask[None, :], other=0.0)
        m, denom, acc = _online_update(q, keys.to(q.dtype), valid, m, denom, acc, scale)
    if HAS_ENTRIES:
        entry_first = tl.maximum(first - window_tiles, 0)
        for tile in range(entry_first, tl.maximum(last - window_tiles, entry_first)):
            n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            if ALL_VISIBLE:
                ids = tl.where(n < count, n, -1)
            else:
                ids = tl.load(entry_ids_ptr + row * stride_ids_row + n, mask=n < count, other=-1)
            valid = (ids >= 0) & ((live + tl.zeros([BLOCK_N], tl.int64)) > 0)
            first_token = tl.where(valid, ids, 0).to(tl.int64) * RATIO
            k_rows = pool_ptr + pool_offsets(
                tables_ptr + row * stride_tables_row, first_token[:, None], offs_d[None, :],
                valid[:, None] & dim_mask[None, :], num_blocks, RATIO, BLOCK_SIZE,
                ROWS_PER_BLOCK, PART_WIDTH, PARTS,
            )  # fmt: skip
            keys = tl.load(k_rows, mask=valid[:, None] & dim_mask[None, :], other=0.0)
            m, denom, acc = _online_update(q, keys.to(q.dtype), valid, m, denom, acc, scale)
    out_mask = head_mask[:, None] & dim_mask[None, :]
    if num_splits > 1:  # a runtime branch: partial results for _v4_merge_kernel
        part = (row * NUM_HEADS + heads) * num_splits + split
        tl.store(partial_stats_ptr + part * 2, m, mask=head_mask)
        tl.store(partial_stats_ptr + part * 2 + 1, denom, mask=head_mask)
        tl.store(partial_acc_ptr + part[:, None] * DIM + offs_d[None, :], acc, mask=out_mask)
    else:
        sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None] / denom[:, None]
        out_rows = (
            out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + offs_d[None, :]
        )
        tl.store(out_rows, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _v4_merge_kernel(
    partial_acc_ptr,
    partial_stats_ptr,
    sinks_ptr,
    out_ptr,
    num_splits,
    stride_out_row,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # MAX_SPLITS: fixed, never a runtime length
    BLOCK_D: tl.constexpr,
):
    """One program per (row, head): the splits' partial softmaxes and the sink as one."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask, d_mask = offs_s < num_splits, offs_d < DIM
    part = (row * NUM_HEADS + head) * num_splits + offs_s
    m = tl.load(partial_stats_ptr + part * 2, mask=s_mask, other=float("-inf"))
    denom = tl.load(partial_stats_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    sink = tl.load(sinks_ptr + head).to(tl.float32)
    m_all = tl.maximum(tl.max(m, 0), sink)  # finite: the sink is
    weight = tl.exp(m - m_all)  # 0 for an empty split (m = -inf)
    total = tl.sum(denom * weight, 0) + tl.exp(sink - m_all)
    acc = tl.load(
        partial_acc_ptr + part[:, None] * DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    merged = tl.sum(tl.where(weight[:, None] > 0, acc * weight[:, None], 0.0), 0) / total
    out_rows = out_ptr + row * stride_out_row + head * stride_out_head + offs_d
    tl.store(out_rows, merged.to(out_ptr.dtype.element_ty), mask=d_mask)


MAX_SPLITS = 32  # the merge kernel's tile: one compiled variant for every split count
SPLITS_OVERRIDE: int | None = None  # a fixed split count (benchmarks' A/B), else decode_splits
# The decode kernel's geometry when a call leaves it None: heads and keys per tile, warps
# and pipeline stages; `python -m benchmarks.kernels --only-v4-decode` sweeps them. H100,
# V4's shape at 8K (docs/benchmarks.md): 32 keys a tile and 2 stages took CSA from 11.4 to
# 10.9 us at 1 row and 104.9 to 88.0 at 64, HCA from 17.6 to 12.9 at 1 row, against 16 keys
# and Triton's 3 stages; no other of the 48 geometries was faster on all of them.
BLOCK_H, BLOCK_N = 16, 32
NUM_WARPS: int | None = 4
NUM_STAGES: int | None = 2
# CSA (chosen ids: entries gathered from scattered pool rows) per case, H100 at 8K / 64K
# (`--only-v4-decode --short`): once the rows fill the SMs (one split) a third stage hides
# the gather (64 rows: 89.4 -> 78.0 us / 134.7 -> 76.0); split over the SMs, 8 warps (1 row:
# 10.9 -> 9.7 / 11.8 -> 9.6). HCA and the window alone keep the geometry above.
CSA_FILLED = (16, 32, 4, 3)
CSA_SPLIT = (16, 32, 8, 2)


def decode_geometry(chosen_ids: bool, splits: int) -> tuple[int, int, int | None, int | None]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages) of a call that names none: CSA_FILLED or
    CSA_SPLIT for chosen ids (by ``splits``: 1 when the rows fill the SMs), else the module's
    BLOCK_H, BLOCK_N, NUM_WARPS, NUM_STAGES."""
    if chosen_ids:
        return CSA_FILLED if splits == 1 else CSA_SPLIT
    return BLOCK_H, BLOCK_N, NUM_WARPS, NUM_STAGES


def decode_splits(q: torch.Tensor, head_blocks: int) -> int:
    """Splits of each row's keys: enough programs for twice the SMs at this batch, none once
    the rows fill the SMs (H200, batch 64: 2 splits were 5% slower a step), from the shapes
    only (CUDA-graph replays agree); 1 in the interpreter (it pays per program)."""
    if not q.is_cuda:
        return 1
    if SPLITS_OVERRIDE is not None:
        return SPLITS_OVERRIDE
    programs, sms = q.shape[0] * head_blocks, multi_processors(q.device)
    if programs >= sms:  # the rows alone fill the GPU: a split only adds the merge's traffic
        return 1
    return min(triton.cdiv(2 * sms, programs), MAX_SPLITS)


def v4_decode_attention(
    q, ring, state_slots, positions, context_lens, pool, entry_ids, block_tables,
    ratio: int, block_size: int, sinks, scale: float, *, num_splits: int | None = None,
    block_h: int | None = None, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton `v4_decode_attention_reference` (same arguments, same result).

    ``num_splits``: programs sharing each (row, head block)'s keys, their partial softmaxes
    merged by a second launch with the sink (None: `decode_splits`; at batch 1 the 4 head
    blocks of a 64-head layer alone would leave most of the SMs idle). ``block_h`` /
    ``block_n`` (heads and keys a tile), ``num_warps`` / ``num_stages``: the launch's
    geometry (all None: `decode_geometry`'s for the case; one None: the module's BLOCK_H,
    BLOCK_N, NUM_WARPS, NUM_STAGES)."""
    if not use_triton(q):
        return v4_decode_attention_reference(
            q, ring, state_slots, positions, context_lens, pool, entry_ids, block_tables,
            ratio, block_size, sinks, scale,
        )  # fmt: skip
    num_rows, num_heads, dim = q.shape
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    assert ring.is_contiguous() and q.stride(-1) == 1
    has_entries = pool is not None
    all_visible = has_entries and entry_ids is None
    if (block_h, block_n, num_warps, num_stages) == (None,) * 4:
        splits = num_splits or decode_splits(q, triton.cdiv(num_heads, BLOCK_H))
        block_h, block_n, num_warps, num_stages = decode_geometry(
            has_entries and not all_visible, splits
        )
    if not has_entries:
        pool, ratio = ring, 1
    if entry_ids is None:  # not read (no entries, or every visible one): any int tensor
        entry_ids = torch.full((num_rows, 1), -1, device=q.device)
    assert pool.is_contiguous()
    block_h = BLOCK_H if block_h is None else block_h
    block_n = BLOCK_N if block_n is None else block_n
    launch = {}
    for knob, value in (
        ("num_warps", num_warps or NUM_WARPS),
        ("num_stages", num_stages or NUM_STAGES),
    ):
        if value is not None:
            launch[knob] = value
    head_blocks = triton.cdiv(num_heads, block_h)
    splits = decode_splits(q, head_blocks) if num_splits is None else num_splits
    assert 1 <= splits <= MAX_SPLITS, f"num_splits must be in 1..{MAX_SPLITS}"
    if splits > 1:
        partial_stats = q.new_empty((num_rows, num_heads, splits, 2), dtype=torch.float32)
        partial_acc = q.new_empty((num_rows, num_heads, splits, dim), dtype=torch.float32)
    else:
        partial_acc = partial_stats = placeholder(q.device)
    block_d = max(16, triton.next_power_of_2(dim))
    _v4_decode_kernel[(num_rows, head_blocks, splits)](
        q, ring, state_slots, positions, context_lens, pool, entry_ids, block_tables, sinks,
        out, partial_acc, partial_stats, entry_ids.shape[1], block_tables.stride(0),
        max(1, pool.shape[0] - 1), scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), entry_ids.stride(0),
        NUM_HEADS=num_heads, DIM=dim, WINDOW=ring.shape[1], SCRATCH=ring.shape[0] - 1,
        RATIO=ratio, BLOCK_SIZE=block_size,
        ROWS_PER_BLOCK=rows_per_block(block_size, ratio) if has_entries else 1,
        PART_WIDTH=pool.shape[-1], PARTS=entry_parts(block_size, ratio) if has_entries else 1,
        HAS_ENTRIES=has_entries, ALL_VISIBLE=all_visible, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_D=block_d, **launch,
    )  # fmt: skip
    if splits > 1:
        _v4_merge_kernel[(num_rows, num_heads)](
            partial_acc, partial_stats, sinks, out, splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, DIM=dim, BLOCK_S=MAX_SPLITS, BLOCK_D=block_d,
        )  # fmt: skip
    return out

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
  folded in at the end: one pass over window + entries + sink. Runtime lengths:
  `num_entries` and the page-table row stride (do_not_specialize); geometry constexpr
  (head dim, window, ratio, block size).
  Offsets int64. Static shapes, no host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

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
    for start in range(0, WINDOW, BLOCK_N):  # the window ring: row j holds position p % W == j
        j = start + tl.arange(0, BLOCK_N)
        key_pos = position - ((position - j) % WINDOW + WINDOW) % WINDOW
        valid = (j < WINDOW) & (key_pos >= 0) & ((live + tl.zeros([BLOCK_N], tl.int64)) > 0)
        k_rows = ring_ptr + (slot * WINDOW + j)[:, None] * DIM + offs_d[None, :]
        keys = tl.load(k_rows, mask=valid[:, None] & dim_mask[None, :], other=0.0)
        m, denom, acc = _online_update(q, keys.to(q.dtype), valid, m, denom, acc, scale)
    if HAS_ENTRIES:
        if ALL_VISIBLE:  # every entry the row may see: a loop bound from its own position
            count = tl.where(live > 0, (position + 1) // RATIO, 0)
        else:  # the row's chosen ids (a list of num_entries, -1 = none)
            count = num_entries
        for start in range(0, count, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
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
    sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
    m_new = tl.maximum(m, sink)
    alpha = tl.exp(m - m_new)
    denom = denom * alpha + tl.exp(sink - m_new)
    acc = acc * alpha[:, None] / denom[:, None]
    out_rows = out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + offs_d[None, :]
    tl.store(
        out_rows, acc.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :]
    )


def v4_decode_attention(
    q, ring, state_slots, positions, context_lens, pool, entry_ids, block_tables,
    ratio: int, block_size: int, sinks, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Triton `v4_decode_attention_reference` (same arguments, same result)."""
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
    if not has_entries:
        pool, ratio = ring, 1
    if entry_ids is None:  # not read (no entries, or every visible one): any int tensor
        entry_ids = torch.full((num_rows, 1), -1, device=q.device)
    assert pool.is_contiguous()
    block_h = 16
    _v4_decode_kernel[(num_rows, triton.cdiv(num_heads, block_h))](
        q, ring, state_slots, positions, context_lens, pool, entry_ids, block_tables, sinks,
        out, entry_ids.shape[1], block_tables.stride(0), max(1, pool.shape[0] - 1), scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), entry_ids.stride(0),
        NUM_HEADS=num_heads, DIM=dim, WINDOW=ring.shape[1], SCRATCH=ring.shape[0] - 1,
        RATIO=ratio, BLOCK_SIZE=block_size,
        ROWS_PER_BLOCK=rows_per_block(block_size, ratio) if has_entries else 1,
        PART_WIDTH=pool.shape[-1], PARTS=entry_parts(block_size, ratio) if has_entries else 1,
        HAS_ENTRIES=has_entries, ALL_VISIBLE=all_visible, BLOCK_H=block_h, BLOCK_N=16,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
    )  # fmt: skip
    return out

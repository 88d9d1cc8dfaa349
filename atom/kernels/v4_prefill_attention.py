"""DeepSeek-V4 prefill attention: each query's window, its compressed entries and a sink.

The prefill of one sequence (queries at positions ``query_start .. query_start + T - 1``):
query t at position p attends, in one softmax with the per-head sink logit (K = V, one
shared head, as `attend_with_sink`):
- its sliding window: positions ``max(0, p - window + 1) .. p`` of ``window_keys``
  ``[L, D]`` (row r holds position ``key_first + r``: the ring's older positions, then the
  step's new keys, as atom/attention/v4.py's `window_prefill` returns them);
- its compressed entries (``entries`` ``[N, D]``, entry w pooled from tokens
  ``w * ratio ..``): with ``entry_ids=None`` (HCA) every visible one, ``w < (p + 1) //
  ratio``; else (CSA) the ids of row t of ``entry_ids`` ``[T, K]`` (-1 = none; the picks
  first, -1 after them, at most ``(p + 1) // ratio`` picks: what `select_topk` and
  `indexer_topk_select` write).

`v4_prefill_attention_reference` is the torch math (a dense [T, keys] mask, the engine's
CPU path, in query chunks). Triton `v4_prefill_attention` (beside it): one program per
(query token, block of heads): the heads are the M dimension of both `tl.dot`s (the query
is [BLOCK_H, D]), the token's keys are gathered tile by tile (BLOCK_N rows of D) from its
window rows, then from its entry ids (or every visible entry), folded by an online softmax
in fp32 (`_online_update`, the decode kernel's), the sink folded in at the end. Never a
[T, H, keys] score tensor: memory is the output's. The loops' bounds come from each
token's position (its window start and visible entries), so the cost follows the prompt.
Dtypes: q, the window keys and the entries in the model's dtype (bf16 or fp32; keys cast to
q's), ids int32 or int64, sinks fp32; the output in q's dtype.
Runtime lengths: the number of queries (the grid) and (do_not_specialize) the first query's
and first key's positions, the entry count and the id rows' width and stride; geometry
constexpr (head count, head dim, window, ratio, tiles). Offsets int64.
"""

from __future__ import annotations

import torch

from atom.kernels.platform import use_triton
from atom.kernels.v4_attention import _online_update, attend_with_sink

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


def v4_prefill_attention_reference(
    q: torch.Tensor,
    window_keys: torch.Tensor,
    key_first: int,
    query_start: int,
    entries: torch.Tensor | None,
    entry_ids: torch.Tensor | None,
    ratio: int,
    window: int,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q ``[T, H, D]`` at positions ``query_start + t``; window_keys ``[L, D]`` at positions
    ``key_first + r`` (holding every query's window: ``key_first <= max(0, query_start -
    window + 1)``, ``L >= query_start + T - key_first``); entries ``[N, D]`` or None (window
    only); entry_ids ``[T, K]`` int (-1 = none) or None (every visible entry); sinks ``[H]``
    -> ``[T, H, D]``. A dense mask over the chunk's window keys and all N entries."""
    num_queries = q.shape[0]
    first, end = query_start, query_start + num_queries
    lo = max(key_first, first - window + 1)
    keys = window_keys[lo - key_first : end - key_first]
    key_pos = torch.arange(lo, end, device=q.device)
    query_pos = torch.arange(first, end, device=q.device)
    valid = (key_pos[None, :] <= query_pos[:, None]) & (
        key_pos[None, :] > query_pos[:, None] - window
    )
    if entries is not None:
        num_entries = entries.shape[0]
        if entry_ids is None:  # every visible entry
            ids = torch.arange(num_entries, device=q.device)
            visible = ids[None, :] < ((query_pos + 1) // ratio)[:, None]
        else:  # the chosen ones (-1 and ids past the entries go to a dropped column)
            ids = entry_ids.long()
            ids = torch.where((ids < 0) | (ids >= num_entries), num_entries, ids)
            picked = torch.zeros(num_queries, num_entries + 1, dtype=torch.bool)
            picked = picked.to(q.device)
            picked.scatter_(1, ids, True)
            visible = picked[:, :-1]
        keys = torch.cat([keys, entries.to(keys.dtype)])
        valid = torch.cat([valid, visible], dim=1)
    return attend_with_sink(q, keys, valid, sinks, scale)


# -- Triton ------------------------------------------------------------------------------------


@triton.jit(
    do_not_specialize=["query_start", "key_first", "num_entries", "num_ids", "stride_ids_row"]
)
def _v4_prefill_kernel(
    q_ptr,  # [T, H, D]
    keys_ptr,  # [L, D] window keys, row r at position key_first + r
    entries_ptr,  # [N, D] (read only with HAS_ENTRIES)
    ids_ptr,  # [T, K] int entry ids, -1 = none (read only without ALL_VISIBLE)
    sinks_ptr,  # [H]
    out_ptr,  # [T, H, D]
    query_start,
    key_first,
    num_entries,
    num_ids,
    scale,
    stride_q_row,
    stride_q_head,
    stride_keys_row,
    stride_entries_row,
    stride_ids_row,
    stride_out_row,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    WINDOW: tl.constexpr,
    RATIO: tl.constexpr,
    HAS_ENTRIES: tl.constexpr,
    ALL_VISIBLE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask, dim_mask = heads < NUM_HEADS, offs_d < DIM
    position = query_start + token  # int64
    q_rows = q_ptr + token * stride_q_row + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_rows, mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # 1. the window: positions lo .. position, rows of the keys tensor from key_first
    lo = tl.maximum(position - WINDOW + 1, 0)
    for tile_start in range(lo, position + 1, BLOCK_N):
        key_pos = tile_start + tl.arange(0, BLOCK_N)
        valid = key_pos <= position
        k_rows = keys_ptr + (key_pos - key_first)[:, None] * stride_keys_row + offs_d[None, :]
        keys = tl.load(k_rows, mask=valid[:, None] & dim_mask[None, :], other=0.0)
        m, denom, acc = _online_update(q, keys.to(q.dtype), valid, m, denom, acc, scale)
    # 2. the entries: every visible one, or the token's ids (picks first, -1 after)
    if HAS_ENTRIES:
        count = tl.minimum((position + 1) // RATIO, num_entries)
        if not ALL_VISIBLE:
            count = tl.minimum(count, num_ids)
        for tile_start in range(0, count, BLOCK_N):
            n = tile_start + tl.arange(0, BLOCK_N)
            if ALL_VISIBLE:
                ids = tl.where(n < count, n, -1).to(tl.int64)
            else:
                ids = tl.load(ids_ptr + token * stride_ids_row + n, mask=n < count, other=-1)
                ids = ids.to(tl.int64)
            valid = (ids >= 0) & (ids < num_entries)
            e_rows = entries_ptr + tl.where(valid, ids, 0)[:, None] * stride_entries_row
            keys = tl.load(
                e_rows + offs_d[None, :], mask=valid[:, None] & dim_mask[None, :], other=0.0
            )
            m, denom, acc = _online_update(q, keys.to(q.dtype), valid, m, denom, acc, scale)
    # 3. the sink: probability mass without a value
    sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
    m_new = tl.maximum(m, sink)
    alpha = tl.exp(m - m_new)
    denom = denom * alpha + tl.exp(sink - m_new)
    acc = acc * alpha[:, None] / denom[:, None]
    out_rows = out_ptr + token * stride_out_row + heads[:, None] * stride_out_head + offs_d[None, :]
    tl.store(
        out_rows,
        acc.to(out_ptr.dtype.element_ty),
        mask=head_mask[:, None] & dim_mask[None, :],
    )


# geometry at the benchmark's shape (64 heads of 512): a [32, 512] query tile and a [32, 512]
# fp32 accumulator per program; `benchmarks.deepseek_v4_prefill` times the kernel in the engine
BLOCK_H = 32
BLOCK_N = 32
NUM_WARPS = 8
NUM_STAGES = 2


def v4_prefill_attention(
    q, window_keys, key_first: int, query_start: int, entries, entry_ids, ratio: int,
    window: int, sinks, scale: float, *, block_h: int = BLOCK_H, block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
) -> torch.Tensor:  # fmt: skip
    """Triton `v4_prefill_attention_reference` (same arguments, same result up to the
    order of fp32 sums); the torch reference where Triton does not run. ``block_h``,
    ``block_n``, ``num_warps``, ``num_stages``: the geometry (a sweep's knobs)."""
    if not use_triton(q):
        return v4_prefill_attention_reference(
            q, window_keys, key_first, query_start, entries, entry_ids, ratio, window,
            sinks, scale,
        )  # fmt: skip
    num_queries, num_heads, dim = q.shape
    out = torch.empty_like(q)
    if num_queries == 0:
        return out
    assert q.stride(-1) == 1 and window_keys.stride(-1) == 1
    assert key_first <= max(0, query_start - window + 1), "window keys start too late"
    assert window_keys.shape[0] >= query_start + num_queries - key_first, "window keys too short"
    has_entries = entries is not None
    all_visible = has_entries and entry_ids is None
    num_entries = entries.shape[0] if has_entries else 0
    num_ids = 0 if entry_ids is None else entry_ids.shape[1]
    # tensors not read (no entries, no ids, or none yet: an empty tensor's pointer may not
    # be one Triton accepts) are stood in for by real ones; the counts keep them unread
    if num_entries == 0:
        entries = window_keys
    assert entries.stride(-1) == 1
    if num_ids == 0:
        entry_ids = torch.full((1, 1), -1, dtype=torch.int64, device=q.device)  # as the selects
    block_h = max(16, min(block_h, triton.next_power_of_2(num_heads)))  # tl.dot's M >= 16
    grid = (num_queries, triton.cdiv(num_heads, block_h))
    _v4_prefill_kernel[grid](
        q, window_keys, entries, entry_ids, sinks, out,
        query_start, key_first, num_entries, num_ids, scale,
        q.stride(0), q.stride(1), window_keys.stride(0), entries.stride(0),
        entry_ids.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, DIM=dim, WINDOW=window, RATIO=max(1, ratio),
        HAS_ENTRIES=has_entries, ALL_VISIBLE=all_visible, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out

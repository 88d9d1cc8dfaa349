"""DeepSeek-V4 lightning indexer: scores of compressed entries and the top-k choice.

score(t, w) = sum_h weight[t, h] * ReLU(q[t, h] . key[w]) * index_head_dim^-0.5, over the
entries visible to query t (w < (t + 1) // ratio). The top ``index_topk`` are kept.

Tie-break (ReLU makes exact ties common: every head negative gives 0): among equal scores
the lower entry index wins. `select_topk` implements it with a stable descending sort;
invalid picks (fewer visible entries than k) are -1.

Triton `indexer_topk_decode` (beside `indexer_topk_decode_reference`): a fixed grid of
`SPLITS` programs per row strides over the row's own visible entries only (the loop stops
at ``(position + 1) // ratio``, never at `max_entries`, which only sizes the scores row),
maps each entry to its pool row through the page-table row, scores it against every
indexer head (`tl.dot`, fp32 accumulation) and applies ReLU, the scale and the head
weights; the top-k is then `indexer_topk_select` (atom/kernels/v4_topk.py, a select over
the same visible entries; the scoring launch also writes each row's visible count). Cost
follows the sequence, not `max_model_len`; no host sync, CUDA-graph capturable. Runtime
lengths: `max_entries` and the page-table row stride (do_not_specialize). The ids come in
ascending order, -1 after them.
"""

from __future__ import annotations

import torch

from atom.kernels.decode_attention import multi_processors
from atom.kernels.platform import use_triton
from atom.kernels.v4_compressor import (
    entry_parts,
    gather_entries,
    pool_offsets,
    rows_per_block,
)
from atom.kernels.v4_topk import (
    INTERPRETER_MULTI_PROCESSORS,
    indexer_topk_select,
    visible_counts,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """q ``[T, H, D]``, keys ``[T, N, D]`` (or ``[N, D]``), weights ``[T, H]`` fp32 -> ``[T, N]``."""
    equation = "thd,nd->thn" if keys.dim() == 2 else "thd,tnd->thn"
    scores = torch.einsum(equation, q.float(), keys.float()).relu() * q.shape[-1] ** -0.5
    return (scores * weights[:, :, None]).sum(dim=1)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """Entry ids ``[T, min(topk, N)]`` of the best visible scores (ties: lower id), -1 pads."""
    k = min(topk, scores.shape[-1])
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.where(visible.gather(1, order), order, torch.full_like(order, -1))


def indexer_topk_decode_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_pool: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    context_lens: torch.Tensor,
    ratio: int,
    block_size: int,
    topk: int,
    max_entries: int,
) -> torch.Tensor:
    """One query per row over its first ``max_entries`` entry slots (static shapes).

    q ``[B, H, D]``, weights ``[B, H]`` fp32, index_pool ``[num_blocks + 1, rows, D]``;
    returns ``[B, min(topk, max_entries)]`` int64 entry ids in ascending order (the order
    `indexer_topk_select` writes), -1 after them."""
    ids = torch.arange(max_entries, device=q.device)[None].expand(q.shape[0], -1)
    keys = gather_entries(index_pool, block_tables, ids, ratio, block_size)
    visible = (ids < ((positions.long() + 1) // ratio)[:, None]) & (context_lens > 0)[:, None]
    chosen = select_topk(index_scores(q, keys, weights), visible, topk)
    return ascending_ids(chosen)


def ascending_ids(chosen: torch.Tensor) -> torch.Tensor:
    """Entry ids ``[T, k]`` (-1 = none) sorted ascending with the -1 after the ids."""
    none = torch.iinfo(chosen.dtype).max
    chosen = torch.where(chosen < 0, none, chosen).sort(dim=-1).values
    return torch.where(chosen == none, -1, chosen)


def index_scores_decode_reference(
    q, weights, index_pool, block_tables, positions, context_lens, ratio: int,
    block_size: int, max_entries: int,
) -> torch.Tensor:  # fmt: skip
    """Scores ``[B, max_entries]`` of every entry slot, -inf where the row may not see it."""
    ids = torch.arange(max_entries, device=q.device)[None].expand(q.shape[0], -1)
    keys = gather_entries(index_pool, block_tables, ids, ratio, block_size)
    visible = (ids < ((positions.long() + 1) // ratio)[:, None]) & (context_lens > 0)[:, None]
    return index_scores(q, keys, weights).masked_fill(~visible, float("-inf"))


# -- Triton ------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["max_entries", "stride_tables_row"])
def _index_scores_kernel(
    q_ptr,
    weights_ptr,
    pool_ptr,
    tables_ptr,
    positions_ptr,
    context_lens_ptr,
    scores_ptr,
    counts_ptr,  # out [B] int64: the entries each row sees (`visible_counts`)
    max_entries,
    stride_tables_row,
    num_blocks,
    scale,
    stride_q_row,
    stride_q_head,
    stride_weights_row,
    NUM_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    RATIO: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS_PER_BLOCK: tl.constexpr,
    PART_WIDTH: tl.constexpr,  # channels per pool row: DIM, or a part of it (`pool_layout`)
    PARTS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split, num_splits = tl.program_id(1), tl.num_programs(1)
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask, dim_mask = heads < NUM_HEADS, offs_d < DIM
    position = tl.load(positions_ptr + row).to(tl.int64)
    live = tl.load(context_lens_ptr + row)
    # the row's own entries only: the loop stops at its visible count, not at max_entries
    num_visible = tl.minimum((position + 1) // RATIO, max_entries)
    num_visible = tl.where(live > 0, num_visible, 0)
    if split == 0:  # the select's counts, here rather than in 6 torch ops
        tl.store(counts_ptr + row, num_visible)
    q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=head_mask[:, None] & dim_mask[None, :], other=0.0)  # fmt: skip
    weights = tl.load(weights_ptr + row * stride_weights_row + heads, mask=head_mask, other=0.0)
    for start in range(split * BLOCK_N, num_visible, num_splits * BLOCK_N):
        ids = start + tl.arange(0, BLOCK_N)
        visible = ids < num_visible
        first_token = tl.where(visible, ids, 0).to(tl.int64) * RATIO
        offsets = pool_offsets(
            tables_ptr + row * stride_tables_row, first_token[:, None], offs_d[None, :],
            visible[:, None] & dim_mask[None, :], num_blocks, RATIO, BLOCK_SIZE,
            ROWS_PER_BLOCK, PART_WIDTH, PARTS,
        )  # fmt: skip
        keys = tl.load(pool_ptr + offsets, mask=visible[:, None] & dim_mask[None, :], other=0.0)
        dots = tl.dot(q, tl.trans(keys.to(q.dtype)), input_precision="ieee")  # [heads, ids]
        scores = tl.sum(tl.maximum(dots, 0.0) * scale * weights[:, None], axis=0)
        tl.store(scores_ptr + row * max_entries + ids, scores, mask=visible)


SPLITS = 256  # programs per row of the scores kernel at most (each strides over its entries)


def index_scores_decode(
    q, weights, index_pool, block_tables, positions, context_lens, ratio: int,
    block_size: int, max_entries: int, fill_invisible: bool = True, counts=None,
    num_splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton scores ``[B, max_entries]`` fp32 of every entry slot (-inf where the row may
    not see it): the scoring half of `indexer_topk_decode` (DeepSeek-V4.1 reads its KV
    source's keys with it and chooses with atom/kernels/v41_topk.py). The kernel reads and
    writes only each row's visible entries; ``fill_invisible=False`` leaves the rest
    unwritten (`indexer_topk_select` never reads them) instead of -inf (a fill of the row).
    ``counts`` ``[B]`` int64, if given, receives `visible_counts` (written by the same
    launch). ``num_splits``: programs per row (a launch size, not a variant; None: as many
    as the row's tiles, at most SPLITS: the decode rule for few rows)."""
    if not use_triton(q):
        if counts is not None:
            counts.copy_(visible_counts(positions, context_lens, ratio, max_entries))
        return index_scores_decode_reference(
            q, weights, index_pool, block_tables, positions, context_lens, ratio, block_size,
            max_entries,
        )  # fmt: skip
    num_rows, num_heads, dim = q.shape
    if counts is None:  # written all the same (one store a row)
        counts = torch.empty(num_rows, dtype=torch.int64, device=q.device)
    assert counts.shape == (num_rows,) and counts.dtype == torch.int64
    scores = torch.empty(num_rows, max_entries, device=q.device, dtype=torch.float32)
    if fill_invisible:
        scores.fill_(float("-inf"))
    if num_rows:
        assert index_pool.is_contiguous() and q.stride(-1) == 1 and weights.stride(-1) == 1
        block_n = 32
        splits = min(SPLITS, triton.cdiv(max_entries, block_n))  # a launch size, no variant
        if num_splits is not None:
            splits = max(1, min(splits, num_splits))
        _index_scores_kernel[(num_rows, splits)](
            q, weights, index_pool, block_tables, positions, context_lens, scores, counts,
            max_entries, block_tables.stride(0), index_pool.shape[0] - 1, dim**-0.5,
            q.stride(0), q.stride(1), weights.stride(0),
            NUM_HEADS=num_heads, DIM=dim, RATIO=ratio, BLOCK_SIZE=block_size,
            ROWS_PER_BLOCK=rows_per_block(block_size, ratio), PART_WIDTH=index_pool.shape[-1],
            PARTS=entry_parts(block_size, ratio),
            BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_N=block_n,
            BLOCK_D=max(16, triton.next_power_of_2(dim)),
        )  # fmt: skip
    return scores


def indexer_topk_decode(
    q, weights, index_pool, block_tables, positions, context_lens, ratio: int,
    block_size: int, topk: int, max_entries: int,
) -> torch.Tensor:  # fmt: skip
    """Triton scores + `indexer_topk_select` (same arguments and result as the reference):
    both read only each row's visible entries."""
    if not use_triton(q):
        return indexer_topk_decode_reference(
            q, weights, index_pool, block_tables, positions, context_lens, ratio,
            block_size, topk, max_entries,
        )  # fmt: skip
    counts = torch.empty(q.shape[0], dtype=torch.int64, device=q.device)
    scores = index_scores_decode(
        q, weights, index_pool, block_tables, positions, context_lens, ratio, block_size,
        max_entries, fill_invisible=False, counts=counts,
    )  # fmt: skip
    return indexer_topk_select(scores, counts, min(topk, max_entries))


# -- prefill: rows are the query tokens of one sequence -----------------------------------------


def indexer_topk_prefill_reference(
    q, weights, index_pool, table, query_start: int, ratio: int, block_size: int, topk: int,
) -> torch.Tensor:  # fmt: skip
    """Queries of one sequence at positions ``query_start + t`` (q ``[T, H, D]``, weights
    ``[T, H]`` fp32), its keys read from ``index_pool`` through its page-table row
    ``table`` ``[1, width]``: ids ``[T, min(topk, N)]`` (N = ``(query_start + T) //
    ratio``, the entries closed by the last query) of each query's best visible entries
    (``w < (p + 1) // ratio``), ascending, -1 after them. `select_topk` over dense scores."""
    positions = torch.arange(query_start, query_start + q.shape[0], device=q.device)
    num_entries = (query_start + q.shape[0]) // ratio
    ids = torch.arange(num_entries, device=q.device)
    keys = gather_entries(index_pool, table, ids[None], ratio, block_size)[0]
    visible = ids[None, :] < ((positions + 1) // ratio)[:, None]
    return ascending_ids(select_topk(index_scores(q, keys, weights), visible, topk))


PREFILL_ROWS = 1024  # query rows scored at once: a [1024, N] fp32 scores tile (64 MB at 16K)
PREFILL_WAVES = 4  # scorer programs per SM at prefill: the rows are many, so few splits


def prefill_splits(num_rows: int, device: torch.device) -> int:
    """Scorer programs per row at prefill: enough for PREFILL_WAVES programs per SM over
    the launch's rows, no more (each program loads the row's [heads, index_head_dim]
    query once and strides over its share of the entries; the decode rule's up to SPLITS
    programs a row would reload it every few tiles). The interpreter counts an H200's SMs."""
    sms = INTERPRETER_MULTI_PROCESSORS
    if device.type == "cuda":
        sms = multi_processors(device)
    return max(1, -(-PREFILL_WAVES * sms // max(1, num_rows)))


def indexer_topk_prefill(
    q, weights, index_pool, table, query_start: int, ratio: int, block_size: int, topk: int,
    *, rows_per_launch: int = PREFILL_ROWS,
) -> torch.Tensor:  # fmt: skip
    """Triton `indexer_topk_prefill_reference` (same arguments, the same sets; fp32 scores
    summed in another order, so near-ties may pick differently): the decode scorer and
    select with the query tokens as rows (`index_scores_decode` over the sequence's row
    repeated by a zero stride, `prefill_splits` programs a row, `indexer_topk_select` with
    each row's own visible count), in launches of ``rows_per_launch`` queries, each scoring
    only the entries its last query sees. Never a ``[T, H, N]`` tensor."""
    if not use_triton(q):
        return indexer_topk_prefill_reference(
            q, weights, index_pool, table, query_start, ratio, block_size, topk
        )
    num_queries = q.shape[0]
    num_entries = (query_start + num_queries) // ratio
    k = min(topk, num_entries)
    out = torch.full((num_queries, k), -1, dtype=torch.int64, device=q.device)
    for first in range(0, num_queries, rows_per_launch):
        last = min(first + rows_per_launch, num_queries)
        width = (query_start + last) // ratio  # the entries this launch's last query sees
        if width == 0:
            continue
        rows = last - first
        positions = torch.arange(query_start + first, query_start + last, device=q.device)
        live = torch.ones(rows, dtype=torch.int32, device=q.device)
        counts = torch.empty(rows, dtype=torch.int64, device=q.device)
        scores = index_scores_decode(
            q[first:last], weights[first:last], index_pool, table.expand(rows, -1), positions,
            live, ratio, block_size, width, fill_invisible=False, counts=counts,
            num_splits=prefill_splits(rows, q.device),
        )  # fmt: skip
        chosen = indexer_topk_select(scores, counts, min(topk, width))
        out[first:last, : chosen.shape[1]] = chosen
    return out

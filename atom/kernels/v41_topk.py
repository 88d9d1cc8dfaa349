"""DeepSeek-V4.1 two-level top-k over the shared compressed entries.

Scores come from the lightning indexer (atom/kernels/v4_indexer.py `index_scores`) against
the keys of the layer's KV source. Entry w is visible to a query at position p when
``w < (p + 1) // ratio``.

Level one (the candidate-source layer): entries are grouped in blocks of
``candidate_block_size``; a block scores the max of its entries (invisible ones -inf); the
block holding the query's newest visible entry is always kept (+inf: it is only partly
filled and could lose to an older full block); the best ``candidate_topk_blocks`` blocks
are taken and those scoring -inf (no visible entry) dropped. Level two (every later index
source): the usual top ``index_topk`` among visible entries, restricted to the candidate
blocks. Ties at both levels: the lower index wins (a stable descending sort, as
`select_topk`); -0.0 equals 0.0. Shapes are static (decode is CUDA-graph capturable).

The torch references serve on CPU, and on CUDA for prefill (no host sync). Decode on CUDA
chooses with V4's select over each row's own entries (`candidate_blocks_decode`,
`two_level_topk_decode`: atom/kernels/v4_topk.py `indexer_topk_select`, no sort of the
``max_model_len``-wide row): the same sets as the references, the ids in ascending order.
An older Triton version (bisection, one kernel) matched them exactly but lost to them on
the GPU; it sits beside the benchmarks as a candidate (benchmarks/candidates/v41_topk.py,
figures in docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from atom.kernels.v4_indexer import select_topk
from atom.kernels.v4_topk import indexer_topk_select


def candidate_blocks_reference(
    scores: torch.Tensor, num_visible: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """scores ``[T, N]`` (invisible entries -inf), num_visible ``[T]`` -> kept ``[T, N]`` bool."""
    width = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -width % block_size), value=float("-inf"))
    block_scores = padded.unflatten(-1, (-1, block_size)).amax(-1)
    num_blocks = block_scores.shape[-1]
    newest = torch.div(num_visible.long() - 1, block_size, rounding_mode="floor")
    ids = torch.arange(num_blocks, device=scores.device)
    block_scores = block_scores.masked_fill(ids[None, :] == newest[:, None], float("inf"))
    # a stable sort, not topk: equal block scores keep the lower block (topk leaves it open)
    top = torch.sort(block_scores, dim=-1, descending=True, stable=True)
    k = min(topk_blocks, num_blocks)
    keep = torch.zeros_like(block_scores, dtype=torch.bool)
    keep.scatter_(-1, top.indices[:, :k], top.values[:, :k] > float("-inf"))
    return keep.repeat_interleave(block_size, dim=-1)[:, :width]


def two_level_topk_reference(
    scores: torch.Tensor,
    visible: torch.Tensor,
    topk: int,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Entry ids ``[T, min(topk, N)]`` (-1 pads) of the best visible scores, inside
    ``candidates`` ``[T, N]`` when given."""
    if candidates is not None:
        visible = visible & candidates
    return select_topk(scores, visible, topk)


def block_scores(scores: torch.Tensor, counts: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each candidate block's score ``[T, ceil(N / block_size)]``: the max of its entries
    (invisible ones -inf), the block of the newest visible entry +inf."""
    width = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -width % block_size), value=float("-inf"))
    blocks = padded.unflatten(-1, (-1, block_size)).amax(-1)
    newest = torch.div(counts.long() - 1, block_size, rounding_mode="floor")
    ids = torch.arange(blocks.shape[-1], device=scores.device)
    return blocks.masked_fill(ids[None, :] == newest[:, None], float("inf"))


def candidate_blocks_decode(
    scores: torch.Tensor, counts: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """`candidate_blocks_reference` at decode (needs Triton): scores ``[T, N]`` (invisible
    entries -inf), counts ``[T]`` each row's visible entries (0 for a padded row) -> kept
    ``[T, N]`` bool. The blocks holding a visible entry are the first
    ``ceil(counts / block_size)``; the select reads only those."""
    width = scores.shape[-1]
    blocks = block_scores(scores, counts, block_size).contiguous()
    num_blocks = blocks.shape[-1]
    block_counts = torch.div(counts.long() + block_size - 1, block_size, rounding_mode="floor")
    chosen = indexer_topk_select(blocks, block_counts, min(topk_blocks, num_blocks))
    keep = torch.zeros(scores.shape[0], num_blocks + 1, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, torch.where(chosen < 0, num_blocks, chosen), True)
    return keep[:, :-1].repeat_interleave(block_size, dim=-1)[:, :width].contiguous()


def two_level_topk_decode(
    scores: torch.Tensor, counts: torch.Tensor, topk: int, candidates: torch.Tensor | None = None
) -> torch.Tensor:
    """`two_level_topk_reference` at decode (needs Triton): entry ids ``[T, min(topk, N)]``
    in ascending order, -1 after them, among each row's first ``counts`` entries (inside
    ``candidates`` when given)."""
    return indexer_topk_select(scores, counts, min(topk, scores.shape[-1]), candidates)

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

The torch references serve on CPU and CUDA alike (no host sync, CUDA-graph capturable). A
Triton version matches them exactly but lost to them on the GPU; it sits beside the
benchmarks as a candidate (benchmarks/candidates/v41_topk.py, figures in docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from atom.kernels.v4_indexer import select_topk


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

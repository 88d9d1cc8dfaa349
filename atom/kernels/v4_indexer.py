"""DeepSeek-V4 lightning indexer: scores of compressed entries and the top-k choice.

score(t, w) = sum_h weight[t, h] * ReLU(q[t, h] . key[w]) * index_head_dim^-0.5, over the
entries visible to query t (w < (t + 1) // ratio). The top ``index_topk`` are kept.

Tie-break (ReLU makes exact ties common: every head negative gives 0): among equal scores
the lower entry index wins. `select_topk` implements it with a stable descending sort;
invalid picks (fewer visible entries than k) are -1.
"""

from __future__ import annotations

import torch

from atom.kernels.v4_compressor import entry_rows


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
    returns ``[B, min(topk, max_entries)]`` int64 entry ids, -1 where there is none."""
    ids = torch.arange(max_entries, device=q.device)[None].expand(q.shape[0], -1)
    rows = entry_rows(block_tables, ids, ratio, block_size, index_pool.shape[0] - 1)
    keys = index_pool.view(-1, index_pool.shape[-1])[rows]
    visible = (ids < ((positions.long() + 1) // ratio)[:, None]) & (context_lens > 0)[:, None]
    return select_topk(index_scores(q, keys, weights), visible, topk)

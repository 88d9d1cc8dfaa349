"""DeepSeek-V4 attention: one softmax over window keys, compressed entries and a sink.

K = V (one shared head). Per query: the sliding window (ring of the sequence's state slot,
``[num_state_slots + 1, window, D]``, position p at row p % window), the compressed entries
it may see (paged pool, atom/kernels/v4_compressor.py) and a learned per-head sink logit
that takes probability mass but carries no value.
"""

from __future__ import annotations

import torch

from atom.kernels.v4_compressor import entry_rows


def attend_with_sink(q, keys, valid, sinks, scale: float) -> torch.Tensor:
    """q ``[T, H, D]``, keys ``[T, L, D]``, valid ``[T, L]`` bool, sinks ``[H]`` -> ``[T, H, D]``."""
    logits = torch.einsum("thd,tld->thl", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(dim=-1)[..., :-1]
    return torch.einsum("thl,tld->thd", probs.to(keys.dtype), keys)


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
    """One query per row: window + entries ``entry_ids`` ``[B, N]`` (-1 = none) + sink.

    Static shapes (CUDA-graph capturable); padded rows (context length 0) attend to
    nothing and return zeros."""
    valid_rows = (context_lens > 0) & (state_slots >= 0)
    slots = torch.where(state_slots < 0, ring.shape[0] - 1, state_slots)
    keys, valid = window_keys(ring, slots, positions, valid_rows)
    if pool is not None:
        rows = entry_rows(block_tables, entry_ids, ratio, block_size, pool.shape[0] - 1)
        entries = pool.view(-1, pool.shape[-1])[rows]
        keys = torch.cat([keys, entries.to(keys.dtype)], dim=1)
        valid = torch.cat([valid, (entry_ids >= 0) & valid_rows[:, None]], dim=1)
    return attend_with_sink(q, keys, valid, sinks, scale)

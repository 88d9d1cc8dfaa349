"""DeepSeek-V4 compressor: partial-window state update and compressed-entry emission.

A compressed layer pools each window of ``ratio`` tokens into one entry (HCA: the window's
own rows; CSA, ``overlap``: the previous window's first half (Ca) and this window's second
half (Cb), 2 * ratio rows) with a softmax over the gate plus ``position_bias``, RMS-norms it
and rotates it at the window's first position. Entry w exists once token
``(w + 1) * ratio - 1`` is processed.

State (per sequence, owned by its KV allocation, atom/model_engine/state_slots.py):
``state_kv`` / ``state_gate`` ``[num_state_slots + 1, R, width]`` in the model dtype, the
raw projections of the last R positions at row ``position % R`` (R = 2 * ratio with
overlap, else ratio); the last slot is scratch for padded rows. Entries live in a paged
pool ``[num_blocks + 1, rows_per_block, dim]`` (last block: scratch) addressed through the
sequence's page-table row: entry w sits in block ``row[w * ratio // block_size]`` at row
``(w * ratio % block_size) // ratio`` (`entry_rows`).
"""

from __future__ import annotations

import torch

from atom.kernels.v4_rope import apply_interleaved_rope_reference


def rows_per_block(block_size: int, ratio: int) -> int:
    if block_size % ratio and ratio % block_size:
        raise ValueError(f"block_size {block_size} and compress ratio {ratio} must divide")
    return max(1, block_size // ratio)


def entry_rows(block_tables, entry_ids, ratio: int, block_size: int, num_blocks: int):
    """Flat pool rows of entries ``entry_ids`` ``[B, N]`` (any int) of each row's sequence."""
    first_token = entry_ids.long().clamp(min=0) * ratio
    column = (first_token // block_size).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables.long().gather(1, column).clamp(0, num_blocks - 1)
    return blocks * rows_per_block(block_size, ratio) + (first_token % block_size) // ratio


def pool_entries(kv_rows, gate_rows, norm_weight, eps: float, cos, sin) -> torch.Tensor:
    """kv/gate rows ``[N, L, D]`` (gate with bias, -inf = absent) -> entries ``[N, D]``."""
    weights = gate_rows.softmax(dim=1, dtype=torch.float32).to(kv_rows.dtype)
    pooled = (kv_rows * weights).sum(dim=1)
    x = pooled.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    normed = (norm_weight * x).to(pooled.dtype)
    return apply_interleaved_rope_reference(normed[:, None, :], cos, sin)[:, 0]


def window_rows(state_kv, state_gate, slots, starts, ratio: int, overlap: bool, bias, dim: int):
    """Pooling rows of the windows starting at ``starts`` [B] of state ``slots`` [B].

    Reads rows ``(start + k) % R``; with overlap the Ca half of the previous window first
    (absent, gate -inf, for the first window)."""
    size = state_kv.shape[1]
    offsets = torch.arange(ratio, device=starts.device)
    current = (starts[:, None] + offsets) % size
    kv = state_kv[slots[:, None], current]
    gate = state_gate[slots[:, None], current].float() + bias
    if not overlap:
        return kv, gate
    previous = (starts[:, None] - ratio + offsets) % size
    ca_kv = state_kv[slots[:, None], previous][..., :dim]
    ca_gate = state_gate[slots[:, None], previous][..., :dim].float() + bias[:, :dim]
    ca_gate = ca_gate.masked_fill((starts < ratio)[:, None, None], float("-inf"))
    kv = torch.cat([ca_kv, kv[..., dim:]], dim=1)
    gate = torch.cat([ca_gate, gate[..., dim:]], dim=1)
    return kv, gate


def compressor_decode_reference(
    state_kv: torch.Tensor,
    state_gate: torch.Tensor,
    kv: torch.Tensor,
    gate: torch.Tensor,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    state_slots: torch.Tensor,
    positions: torch.Tensor,
    block_tables: torch.Tensor,
    pool: torch.Tensor,
    ratio: int,
    overlap: bool,
    block_size: int,
) -> None:
    """One new token per row: write its projections into the state, and where it closes a
    window pool the entry into ``pool``. Rows with state slot -1 (padding) touch only the
    scratch slot and block. Static shapes, no host sync (CUDA-graph capturable).

    kv, gate ``[B, width]``; state_slots ``[B]`` int; positions ``[B]`` int64."""
    scratch = state_kv.shape[0] - 1
    slots = torch.where(state_slots < 0, scratch, state_slots).long()
    positions = positions.long()
    state_kv[slots, positions % state_kv.shape[1]] = kv
    state_gate[slots, positions % state_kv.shape[1]] = gate
    dim = pool.shape[-1]
    starts = ((positions + 1) // ratio - 1).clamp(min=0) * ratio
    kv_rows, gate_rows = window_rows(
        state_kv, state_gate, slots, starts, ratio, overlap, position_bias, dim
    )
    entries = pool_entries(
        kv_rows, gate_rows, norm_weight, eps, cos_table[starts], sin_table[starts]
    )
    num_blocks = pool.shape[0] - 1
    rows = entry_rows(block_tables, starts[:, None] // ratio, ratio, block_size, num_blocks)[:, 0]
    emits = ((positions + 1) % ratio == 0) & (state_slots >= 0)
    rows = torch.where(emits, rows, num_blocks * pool.shape[1])
    pool.view(-1, dim)[rows] = entries.to(pool.dtype)

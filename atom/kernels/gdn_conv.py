"""Causal depthwise conv1d + SiLU over the mixed q/k/v channels of a GDN layer.

out[t, c] = silu(sum_j weight[c, j] * x[t - (K - 1) + j, c]), x before position 0 taken from
the sequence's conv state: the last K - 1 inputs it has seen (zeros at its start).

Shapes: x ``[T, C]``; weight ``[C, K]``; conv_state ``[num_state_slots + 1, K - 1, C]`` in the
model dtype, one row per state slot (atom/model_engine/state_slots.py), row -1 scratch for
padded rows; state_slots ``[B]`` int32 (-1 = padding); fresh ``[B]`` int32 (!= 0: the
sequence starts at position 0, its state is taken as zero).

- ``causal_conv1d_update_*``: one token per row (decode), static shapes, graph capturable.
- ``causal_conv1d_prefill_*``: varlen over ``cu_seqlens``, any start position (a chunk
  boundary inside a conv window continues from the state).
The Triton kernels are in atom/kernels/gdn_recurrent.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rows(state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return torch.where(slots < 0, state.shape[0] - 1, slots).long()


def causal_conv1d_update_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    state_slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """x [B, C], one token per row -> silu(conv) [B, C]; the state rows shift by one."""
    rows = _rows(conv_state, state_slots)
    past = conv_state[rows] * (fresh == 0).to(conv_state.dtype)[:, None, None]
    window = torch.cat([past, x[:, None].to(conv_state.dtype)], dim=1)  # [B, K, C]
    conv_state[rows] = window[:, 1:]
    out = (window.to(weight.dtype) * weight.t()[None]).sum(dim=1)
    return F.silu(out).to(x.dtype)


def causal_conv1d_prefill_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """x [T, C], sequence b owns rows [cu_seqlens[b], cu_seqlens[b + 1]) -> [T, C]."""
    width = weight.shape[1] - 1
    out = torch.empty_like(x)
    cu = cu_seqlens.tolist()  # host read: prefill is never graphed
    rows = _rows(conv_state, state_slots[: len(cu) - 1]).tolist()
    flags = fresh[: len(cu) - 1].tolist()
    for b, (row, is_fresh) in enumerate(zip(rows, flags, strict=True)):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        past = torch.zeros_like(conv_state[row]) if is_fresh else conv_state[row]
        xs = torch.cat([past, x[start:end].to(conv_state.dtype)])  # [K - 1 + n, C]
        conv_state[row] = xs[-width:]
        conv = F.conv1d(xs.t()[None].to(weight.dtype), weight[:, None], groups=weight.shape[0])
        out[start:end] = F.silu(conv[0].t()).to(x.dtype)
    return out

"""DeepSeek-V4 rotary embedding: interleaved pairs on the trailing rope channels.

Each head is laid out ``[nope | rope]``; pair i of the rope slice is channels
``(2i, 2i + 1)`` and turns by ``position * inv_freq[i]``. V4 uses it on queries, on the
shared key/value, on compressed entries (at their window's first position) and, with
``-sin``, on the attention output (K = V carries the rotation into the output).
"""

from __future__ import annotations

import torch


def rope_tables(inv_freq: torch.Tensor, max_position: int, scaling: float = 1.0):
    """(cos, sin) ``[max_position, rope_dim // 2]`` fp32, as HF's `position * inv_freq`."""
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
    return freqs.cos() * scaling, freqs.sin() * scaling


def apply_interleaved_rope_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x ``[T, H, D]``, cos/sin ``[T, R // 2]`` (already in x's dtype or fp32) -> rotated x.

    The rotation runs in fp32 and is cast back once (HF `apply_rotary_pos_emb`)."""
    rope_dim = 2 * cos.shape[-1]
    cos = cos.to(x.dtype).repeat_interleave(2, dim=-1)[:, None, :].float()
    sin = sin.to(x.dtype).repeat_interleave(2, dim=-1)[:, None, :].float()
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    rotated_half = torch.stack((-x2, x1), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)

"""DeepSeek-V4 rotary embedding: interleaved pairs on the trailing rope channels.

Each head is laid out ``[nope | rope]``; pair i of the rope slice is channels
``(2i, 2i + 1)`` and turns by ``position * inv_freq[i]``. V4 uses it on queries, on the
shared key/value, on compressed entries (at their window's first position) and, with
``-sin``, on the attention output (K = V carries the rotation into the output).
"""

from __future__ import annotations

import torch

from atom.kernels.platform import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


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


# -- RMSNorm + rotary in one launch ---------------------------------------------------------
#
# x [T, H, D] (unit stride inside a head) -> out [T, H, D] contiguous, x's dtype:
#   norm "none":       y = x
#   norm "unweighted": y = x * rsqrt(mean(x^2) + eps) (the factor rounded to x's dtype, the
#                      product in x's dtype: the model's `unweighted_rms_norm`, q's per-head)
#   norm "weighted":   y = (weight * (x * rsqrt(mean(x^2) + eps))).to(dtype) (`FP32RMSNorm`);
#                      `round_normed` (V4.1's RMSNorm, the weight in x's dtype): the normed
#                      value rounded to x's dtype before the weight multiply
# then the interleaved rope on y's trailing R channels at each token's position (cos/sin read
# from the [max_position, R // 2] fp32 tables, rounded to x's dtype as the reference does;
# `inverse`: -sin). R = 0: the norm only. Runtime lengths: none (tokens from the grid);
# geometry (constexpr): H, D, R, the norm kind, tiles.

NORM_NONE, NORM_UNWEIGHTED, NORM_WEIGHTED = 0, 1, 2


@triton.jit
def _weighted(weight, normed, dtype: tl.constexpr, ROUND_NORMED: tl.constexpr):
    """weight * normed (fp32 both) in ``dtype``; ``ROUND_NORMED``: normed rounded first."""
    if ROUND_NORMED:
        normed = normed.to(dtype).to(tl.float32)
    return (weight * normed).to(dtype)


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    out_ptr,  # [T, H, D] contiguous
    weight_ptr,  # [D] fp32, or x's dtype with ROUND_NORMED (NORM == 2)
    positions_ptr,  # [T]
    cos_ptr,  # [max_position, R // 2] fp32
    sin_ptr,
    stride_x_row,
    stride_x_head,
    eps,
    sign,  # 1.0, or -1.0 for the inverse rotation
    H: tl.constexpr,
    D: tl.constexpr,
    D_P2: tl.constexpr,
    HALF_R: tl.constexpr,  # R // 2 (0: no rope)
    HALF_R_P2: tl.constexpr,
    NORM: tl.constexpr,
    ROUND_NORMED: tl.constexpr,  # NORM == 2: weight * normed.to(dtype) (V4.1)
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = heads < H
    dtype = out_ptr.dtype.element_ty
    row = x_ptr + token * stride_x_row + heads[:, None] * stride_x_head
    out_row = out_ptr + token * H * D + heads[:, None] * D
    cols = tl.arange(0, D_P2)
    in_d = cols < D
    x = tl.load(row + cols[None, :], mask=in_h[:, None] & in_d[None, :], other=0.0)
    x = x.to(tl.float32)
    factor = tl.full([BLOCK_H], 1.0, tl.float32)
    if NORM != 0:
        factor = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        if NORM == 1:
            factor = factor.to(dtype).to(tl.float32)
    if NORM == 1:
        y = (x * factor[:, None]).to(dtype)
    elif NORM == 2:
        w = tl.load(weight_ptr + cols, mask=in_d, other=0.0).to(tl.float32)
        y = _weighted(w[None, :], x * factor[:, None], dtype, ROUND_NORMED)
    else:
        y = x.to(dtype)
    tl.store(out_row + cols[None, :], y, mask=in_h[:, None] & (cols < D - 2 * HALF_R)[None, :])
    if HALF_R > 0:
        pairs = tl.arange(0, HALF_R_P2)
        in_p = pairs < HALF_R
        mask = in_h[:, None] & in_p[None, :]
        even = D - 2 * HALF_R + 2 * pairs
        position = tl.load(positions_ptr + token).to(tl.int64)
        cos = tl.load(cos_ptr + position * HALF_R + pairs, mask=in_p, other=0.0)
        sin = tl.load(sin_ptr + position * HALF_R + pairs, mask=in_p, other=0.0)
        cos = cos.to(dtype).to(tl.float32)[None, :]
        sin = (sign * sin.to(dtype).to(tl.float32))[None, :]
        x1 = tl.load(row + even[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row + even[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
        if NORM == 1:
            x1 = (x1 * factor[:, None]).to(dtype)
            x2 = (x2 * factor[:, None]).to(dtype)
        elif NORM == 2:
            w1 = tl.load(weight_ptr + even, mask=in_p, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(weight_ptr + even + 1, mask=in_p, other=0.0).to(tl.float32)[None, :]
            x1 = _weighted(w1, x1 * factor[:, None], dtype, ROUND_NORMED)
            x2 = _weighted(w2, x2 * factor[:, None], dtype, ROUND_NORMED)
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        first = x1 * cos + (-x2) * sin
        second = x2 * cos + x1 * sin
        tl.store(out_row + even[None, :], first.to(dtype), mask=mask)
        tl.store(out_row + even[None, :] + 1, second.to(dtype), mask=mask)


def norm_rope(
    x: torch.Tensor,
    positions: torch.Tensor | None,
    cos_table: torch.Tensor | None,
    sin_table: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    inverse: bool = False,
    round_normed: bool = False,
) -> torch.Tensor:
    """x [T, H, D] -> [T, H, D]: RMSNorm (``eps`` None: none; ``weight`` None: the
    unweighted one; ``round_normed``: V4.1's ``weight * normed.to(dtype)``), then the
    interleaved rope at ``positions`` (``cos_table`` None: none, and ``positions`` may be
    None; ``inverse``: the inverse rotation). One Triton launch; the torch reference where
    Triton does not run."""
    if not use_triton(x):
        return norm_rope_reference(
            x, positions, cos_table, sin_table, weight, eps, inverse, round_normed
        )
    tokens, heads, dim = x.shape
    assert x.stride(-1) == 1, "a head's channels must be unit-stride"
    half = 0 if cos_table is None else cos_table.shape[-1]
    norm = NORM_NONE if eps is None else NORM_UNWEIGHTED if weight is None else NORM_WEIGHTED
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    dim_p2 = triton.next_power_of_2(dim)
    block_h = max(1, min(triton.next_power_of_2(heads), 4096 // dim_p2))
    table = cos_table if cos_table is not None else x  # unused pointers when there is no rope
    positions = positions if positions is not None else x
    _norm_rope_kernel[(tokens, triton.cdiv(heads, block_h))](
        x, out, weight if weight is not None else x, positions, table,
        sin_table if sin_table is not None else table, x.stride(0), x.stride(1),
        0.0 if eps is None else float(eps), -1.0 if inverse else 1.0,
        H=heads, D=dim, D_P2=dim_p2, HALF_R=half, HALF_R_P2=triton.next_power_of_2(max(half, 1)),
        NORM=norm, ROUND_NORMED=round_normed and norm == NORM_WEIGHTED, BLOCK_H=block_h,
        num_warps=4 if block_h * dim_p2 <= 2048 else 8,
    )  # fmt: skip
    return out


def norm_rope_reference(x, positions, cos_table, sin_table, weight=None, eps=None,
                        inverse=False, round_normed=False):  # fmt: skip
    """The model's torch ops: `unweighted_rms_norm` / `FP32RMSNorm` (``round_normed``:
    V4.1's `RMSNorm`), then `apply_interleaved_rope_reference` with the tables' rows at
    ``positions``."""
    if eps is not None:
        if weight is None:
            x = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
        else:
            y = x.float()
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
            x = (weight * (y.to(x.dtype) if round_normed else y)).to(x.dtype)
    if cos_table is None:
        return x
    cos, sin = cos_table[positions], sin_table[positions]
    return apply_interleaved_rope_reference(x, cos, -sin if inverse else sin)

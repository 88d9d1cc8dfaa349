"""The qkv projection's GEMV with the attention prologue in its epilogue (batch-1 decode).

atom/kernels/gemv.py's one-row kernel with ROPE_KV: each program owns rotary pairs of rows
(d, d + head_dim / 2) of a head of the fused q | k | v weight, so the RoPE of q and k, the
KV-cache write of k and v and the projection are one launch instead of the GEMV and
atom/kernels/rotary_kv.py's kernel (with the RMSNorm prologue, the layer's first norm too).
The numerics are the two kernels': the projection's outputs rounded to x's dtype, then
rotated as the rotary kernel does (cos / sin rounded to the dtype first, fp32 products,
one rounding), so q and the cache bytes equal GEMV + ``rotary_kv_write`` (up to the
compiler's FMA contraction and the GEMV's summation order, as for the plain GEMV).

Shapes and dtypes: x [1, hidden] (one token); weight [(Hq + 2 Hkv) * D, hidden], x's dtype,
or FP8 e4m3 with ``weight_scale`` float32 [(Hq + 2 Hkv) * D, 1] (one scale per row, as
atom/kernels/gemv.py takes it; block-scaled FP8 keeps the separate kernels); positions [1]
and slot_mapping [1] int32/int64 (slot -1: padding, nothing written); cos / sin
[max_position, D], unit-stride; k_cache / v_cache [blocks, block_size, Hkv, D] contiguous,
x's dtype (fp8 caches keep the separate kernels); returns q [1, Hq * D].
"""

from __future__ import annotations

import torch

from atom.kernels import gemv
from atom.kernels.gemv import gemv_reference, gemv_rms_norm_reference
from atom.kernels.platform import use_triton
from atom.kernels.rope_kv_epilogue import RopeKV
from atom.kernels.rotary_kv import rotary_kv_write_reference


def gemv_rope_kv(x: torch.Tensor, weight: torch.Tensor, rope: RopeKV, norm: tuple | None = None, config=None, bias=None, weight_scale=None):  # fmt: skip
    """q [1, Hq * D] of ``x @ weight.T (+ bias)`` with k and v written to the caches (see
    the module docstring). ``norm`` = (residual or None, norm weight, eps): the RMSNorm (and
    residual add) first, as ``gemv_rms_norm``; then returns (q, x + residual, or x).
    ``config`` (a GemvConfig) overrides ``gemv_config`` (the GEMV policy's trial).
    ``weight_scale``: an FP8 weight's float32 scale per row [rows, 1]."""
    if not use_triton(x):
        return gemv_rope_kv_reference(x, weight, rope, norm, bias, weight_scale)
    assert rope.fits(x, weight), "one token, fused q | k | v rows, caches of x's dtype"
    q = torch.empty(1, rope.num_q_heads * rope.head_dim, dtype=x.dtype, device=x.device)
    layer_args = dict(rope=rope, bias=bias, weight_scale=weight_scale)
    if norm is None:
        gemv._launch(x, weight, q, silu_mul=False, config=config, **layer_args)
        return q
    residual, norm_weight, eps = norm
    residual_out = None if residual is None else torch.empty_like(x)
    norm_args = (residual, norm_weight, eps, residual_out)
    gemv._launch(x, weight, q, False, norm_args, config, **layer_args)
    return q, x if residual is None else residual_out


def gemv_rope_kv_reference(x, weight, rope: RopeKV, norm=None, bias=None, weight_scale=None):
    """The GEMV (or the norm + GEMV) then ``rotary_kv_write_reference``."""
    if norm is None:
        qkv, residual = gemv_reference(x, weight, bias, weight_scale), None
    else:
        qkv, residual = gemv_rms_norm_reference(
            x, norm[0], norm[1], norm[2], weight, bias=bias, weight_scale=weight_scale
        )
    q_size, kv_size = rope.num_q_heads * rope.head_dim, rope.num_kv_heads * rope.head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = rotary_kv_write_reference(
        rope.positions, q.view(1, rope.num_q_heads, rope.head_dim),
        k.view(1, rope.num_kv_heads, rope.head_dim), v.view(1, rope.num_kv_heads, rope.head_dim),
        rope.cos, rope.sin, rope.k_cache, rope.v_cache, rope.slot_mapping,
    ).reshape(1, q_size)  # fmt: skip
    return q if norm is None else (q, residual)

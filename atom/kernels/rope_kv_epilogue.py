"""The RoPE + KV-write epilogue of the one-row GEMV (atom/kernels/gemv_rope_kv.py says what
it computes), and ``RopeKV``, what it needs beside the GEMV's inputs.

Its own module so that atom/kernels/gemv.py's kernel can call the epilogue while
gemv_rope_kv.py's host function launches that kernel (no import circle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


@dataclass(frozen=True)
class RopeKV:
    """What the epilogue needs beside the GEMV's inputs."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def arguments(self) -> tuple:
        """The kernel's arguments after stride_weight, in its order."""
        return (
            self.positions, self.cos, self.sin, self.cos.stride(0), self.k_cache,
            self.v_cache, self.slot_mapping, self.num_q_heads, self.num_kv_heads,
        )  # fmt: skip

    def fits(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the epilogue takes these inputs (else: the GEMV and rotary_kv_write)."""
        rows = (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim
        return (
            x.shape[0] == 1
            and weight.shape[0] == rows
            and self.head_dim % 2 == 0
            and self.k_cache.dtype == x.dtype == self.v_cache.dtype
            and self.k_cache.is_contiguous()
            and self.v_cache.is_contiguous()
            and self.cos.stride(1) == 1
            and self.sin.stride() == self.cos.stride()
            and self.positions.numel() == 1
        )


@triton.jit
def _rope_kv_epilogue(
    first, second, head, dim, mask, q_out_ptr, positions_ptr, cos_ptr, sin_ptr, stride_cos,
    k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_q_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The rotary pairs (first, second) of q | k | v heads: q rotated into q_out, k rotated
    and v as they are into the caches at the token's slot; rounded as the qkv GEMV output
    then atom/kernels/rotary_kv.py's kernel round them (the same bytes)."""
    dtype = q_out_ptr.dtype.element_ty
    x1 = first.to(dtype).to(tl.float32)  # the qkv projection's outputs, rounded
    x2 = second.to(dtype).to(tl.float32)
    position = tl.load(positions_ptr).to(tl.int64)
    angles = position * stride_cos + dim
    cos_first = tl.load(cos_ptr + angles, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin_first = tl.load(sin_ptr + angles, mask=mask, other=0.0).to(dtype).to(tl.float32)
    cos_second = (
        tl.load(cos_ptr + angles + HEAD_DIM // 2, mask=mask, other=0.0).to(dtype).to(tl.float32)
    )
    sin_second = (
        tl.load(sin_ptr + angles + HEAD_DIM // 2, mask=mask, other=0.0).to(dtype).to(tl.float32)
    )
    rotated = head < num_q_heads + num_kv_heads  # q and k heads; v heads as they are
    y1 = tl.where(rotated, (x1 * cos_first - x2 * sin_first).to(dtype), x1.to(dtype))
    y2 = tl.where(rotated, (x2 * cos_second + x1 * sin_second).to(dtype), x2.to(dtype))
    is_q = head < num_q_heads
    q_rows = head.to(tl.int64) * HEAD_DIM + dim
    tl.store(q_out_ptr + q_rows, y1, mask=mask & is_q)
    tl.store(q_out_ptr + q_rows + HEAD_DIM // 2, y2, mask=mask & is_q)
    slot = tl.load(slot_mapping_ptr).to(tl.int64)
    is_k = (head >= num_q_heads) & rotated
    kv_head = tl.where(is_k, head - num_q_heads, head - num_q_heads - num_kv_heads)
    cache = (slot * num_kv_heads + kv_head) * HEAD_DIM + dim
    written = mask & ~is_q & (slot + dim * 0 >= 0)  # a vector, not a scalar
    tl.store(k_cache_ptr + cache, y1, mask=written & is_k)
    tl.store(k_cache_ptr + cache + HEAD_DIM // 2, y2, mask=written & is_k)
    tl.store(v_cache_ptr + cache, y1, mask=written & ~rotated)
    tl.store(v_cache_ptr + cache + HEAD_DIM // 2, y2, mask=written & ~rotated)

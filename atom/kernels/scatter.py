"""Scatter packed segments from one device arena into fixed destinations (packed H2D).

The packed publisher sends every small metadata buffer of a step with one host-to-device
copy into `src`; this kernel then writes each segment to its fixed place in `dst` (the
slot's device arena, where every buffer's CUDA-graph-safe destination lives).

descriptors: int64 [num_segments, 3] rows of (src_offset, dst_offset, num_bytes), in bytes.
Runtime lengths (not constexpr, in do_not_specialize): num_segments, max_chunks.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - references still work without Triton
    triton = None

BLOCK_BYTES = 2048


if triton is not None:

    @triton.jit(do_not_specialize=["num_segments", "max_chunks"])
    def _scatter_segments_kernel(
        src, dst, descriptors, num_segments, max_chunks, BLOCK: tl.constexpr
    ):
        segment = tl.program_id(0)
        chunk = tl.program_id(1)
        src_offset = tl.load(descriptors + segment * 3).to(tl.int64)
        dst_offset = tl.load(descriptors + segment * 3 + 1).to(tl.int64)
        num_bytes = tl.load(descriptors + segment * 3 + 2).to(tl.int64)
        offsets = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < num_bytes
        data = tl.load(src + src_offset + offsets, mask=mask)
        tl.store(dst + dst_offset + offsets, data, mask=mask)


def scatter_segments(
    src: torch.Tensor,
    dst: torch.Tensor,
    descriptors: torch.Tensor,
    num_segments: int,
    max_bytes: int,
) -> None:
    """One kernel launch copying every segment (uint8 arenas, int64 descriptors)."""
    if num_segments == 0:
        return
    max_chunks = triton.cdiv(max_bytes, BLOCK_BYTES)
    grid = (num_segments, max_chunks)
    _scatter_segments_kernel[grid](
        src, dst, descriptors, num_segments, max_chunks, BLOCK=BLOCK_BYTES
    )


def scatter_segments_reference(
    src: torch.Tensor,
    dst: torch.Tensor,
    descriptors: torch.Tensor,
    num_segments: int,
    max_bytes: int,
) -> None:
    for src_offset, dst_offset, num_bytes in descriptors[:num_segments].tolist():
        dst[dst_offset : dst_offset + num_bytes] = src[src_offset : src_offset + num_bytes]

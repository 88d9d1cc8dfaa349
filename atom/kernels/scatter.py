"""Scatter packed segments from one device arena into fixed destinations (packed H2D), and
the placeholder fill of the next step's input ids (``fill_placeholders``).

The packed publisher sends every small metadata buffer of a step with one host-to-device
copy into `src`; this kernel then writes each segment to its fixed place in `dst` (the
slot's device arena, where every buffer's CUDA-graph-safe destination lives).

`src` starts with a header of int64 words: word 0 is the number of segments, then
HEADER_WORDS onwards one (src_offset, dst_offset, num_bytes) row per segment, in bytes.
Offsets and sizes are multiples of 4 (every metadata dtype is 4 or 8 bytes wide), so the
kernel moves 32-bit words. Every runtime length is read from the header on the device:
the launch (grid and arguments) never changes, which makes it capture-safe (the publisher
replays it from a CUDA graph) and leaves nothing to specialize on.

Grid: (max_segments, CHUNK_PROGRAMS); program (s, c) copies words c, c + CHUNK_PROGRAMS,
... (in BLOCK-word chunks) of segment s, or nothing when s >= the segment count.
"""

from __future__ import annotations

import torch

from atom.kernels.platform import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - references still work without Triton
    triton = None

HEADER_WORDS = 1  # int64 words before the descriptor rows
BLOCK_WORDS = 512
CHUNK_PROGRAMS = 4
FILL_BLOCK = 256  # placeholders per program of fill_placeholders


if triton is not None:

    @triton.jit
    def _scatter_segments_kernel(src, dst, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        segment = tl.program_id(0)
        lane = tl.program_id(1)
        header = src.to(tl.pointer_type(tl.int64))
        num_segments = tl.load(header)
        row = header + 1 + segment * 3
        src_word = tl.load(row) // 4
        dst_word = tl.load(row + 1) // 4
        num_words = tl.load(row + 2) // 4
        num_words = tl.where(segment < num_segments, num_words, 0)
        src_words = src.to(tl.pointer_type(tl.int32)) + src_word
        dst_words = dst.to(tl.pointer_type(tl.int32)) + dst_word
        for start in range(lane * BLOCK, num_words, CHUNK * BLOCK):
            offsets = start + tl.arange(0, BLOCK).to(tl.int64)
            mask = offsets < num_words
            tl.store(dst_words + offsets, tl.load(src_words + offsets, mask=mask), mask=mask)


if triton is not None:

    @triton.jit(do_not_specialize=["num"])
    def _fill_placeholders_kernel(ids_ptr, dst_ptr, src_ptr, tokens_ptr, num, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < num
        dst = tl.load(dst_ptr + offsets, mask=mask, other=0).to(tl.int64)
        src = tl.load(src_ptr + offsets, mask=mask, other=0).to(tl.int64)
        tokens = tl.load(tokens_ptr + src, mask=mask, other=0)
        tl.store(ids_ptr + dst, tokens.to(ids_ptr.dtype.element_ty), mask=mask)


def fill_placeholders(
    input_ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, tokens: torch.Tensor
) -> None:
    """``input_ids[dst] = tokens[src]`` (the tokens a step sampled into the placeholders of
    the next one, on the device): one launch instead of a gather and an index_put."""
    assert tokens.dim() == 1 and tokens.stride(0) == 1, "one token per sampled row"
    num = dst.numel()
    if not use_triton(input_ids):
        fill_placeholders_reference(input_ids, dst, src, tokens)
        return
    if num:  # one fixed tile: the count is a runtime length, never a new variant
        grid = (triton.cdiv(num, FILL_BLOCK),)
        _fill_placeholders_kernel[grid](input_ids, dst, src, tokens, num, BLOCK=FILL_BLOCK)


def fill_placeholders_reference(input_ids, dst, src, tokens) -> None:
    input_ids[dst] = tokens[src].to(input_ids.dtype)


def scatter_segments(src: torch.Tensor, dst: torch.Tensor, max_segments: int) -> None:
    """One launch copying every segment described in `src`'s header (uint8 arenas)."""
    grid = (max_segments, CHUNK_PROGRAMS)
    _scatter_segments_kernel[grid](src, dst, CHUNK=CHUNK_PROGRAMS, BLOCK=BLOCK_WORDS)


def scatter_segments_reference(src: torch.Tensor, dst: torch.Tensor) -> None:
    header = src[: 8 * HEADER_WORDS].view(torch.int64)
    num_segments = int(header[0])
    rows = src[8 * HEADER_WORDS : 8 * (HEADER_WORDS + 3 * num_segments)].view(torch.int64)
    for src_offset, dst_offset, num_bytes in rows.view(-1, 3).tolist():
        dst[dst_offset : dst_offset + num_bytes] = src[src_offset : src_offset + num_bytes]

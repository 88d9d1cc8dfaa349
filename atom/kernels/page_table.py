"""Device-side maintenance of the page table's mirror, and the views backends derive.

The versioned page table (atom/model_engine/page_table.py) keeps one row of KV block ids
per batch position on the device. Each step it sends only what changed:

- `apply_row_deltas`: staged `(row, start, block ids)` deltas, one int32 buffer laid out
  [n | rows(n) | starts(n) | offsets(n + 1) | block ids]; delta k writes
  ids[offsets[k]:offsets[k + 1]] into rows[row_k, start_k:]. Appends are one or a few ids
  per row, new rows their whole list.
- `move_rows`: rows that moved to another batch position (requests finished, preempted
  or reordered), one int32 buffer [n | sources(n) | destinations(n) | lengths(n)], through a
  scratch table so that any permutation (cycles included) is safe. Only the valid ids
  move, never the full row width.
- `derive_slot_mapping`: the MHA view, a cache slot per new token,
  slot = rows[row, position // block_size] * block_size + position % block_size,
  -1 for padding tokens (CUDA-graph padded decode batches: context length 0).

Counts are read on the device and grids are fixed (one program per possible row), so
the page table replays its launches from CUDA graphs instead of paying a Triton launch.

Shapes: rows [R, W] int32 (row stride given); positions int64.
Runtime lengths (not constexpr, in do_not_specialize): num_tokens, row strides; the delta
and move counts live in device memory. Geometry (constexpr): BLOCK sizes, block_size,
the HAS_CU and GATHER flags.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - references still work without Triton
    triton = None

BLOCK_IDS = 256  # block ids per program iteration
BLOCK_TOKENS = 256


if triton is not None:

    @triton.jit(do_not_specialize=["row_stride"])
    def _apply_row_deltas_kernel(rows, row_stride, buffer, BLOCK: tl.constexpr):
        # buffer (int32): [n | rows(n) | starts(n) | offsets(n + 1) | block ids]; grid >= n
        k = tl.program_id(0)
        num_deltas = tl.load(buffer)
        deltas = buffer + 1
        row = tl.load(deltas + k).to(tl.int64)
        start = tl.load(deltas + num_deltas + k).to(tl.int64)
        first = tl.load(deltas + 2 * num_deltas + k).to(tl.int64)
        count = tl.load(deltas + 2 * num_deltas + k + 1).to(tl.int64) - first
        count = tl.where(k < num_deltas, count, 0)  # programs past the count write nothing
        blocks = deltas + 3 * num_deltas + 1 + first
        for chunk in range(0, count, BLOCK):
            offsets = chunk + tl.arange(0, BLOCK)
            mask = offsets < count
            ids = tl.load(blocks + offsets, mask=mask)
            tl.store(rows + row * row_stride + start + offsets, ids, mask=mask)

    @triton.jit(do_not_specialize=["src_stride", "dst_stride"])
    def _copy_rows_kernel(
        src, src_stride, dst, dst_stride, buffer, GATHER: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # buffer (int32): [n | sources(n) | destinations(n) | lengths(n)]; grid >= n
        # GATHER: scratch[k] = src[sources[k]]; else dst[destinations[k]] = scratch[k]
        k = tl.program_id(0)
        num_moves = tl.load(buffer)
        moves = buffer + 1
        if GATHER:
            src_row = tl.load(moves + k).to(tl.int64)
            dst_row = k.to(tl.int64)
        else:
            src_row = k.to(tl.int64)
            dst_row = tl.load(moves + num_moves + k).to(tl.int64)
        count = tl.load(moves + 2 * num_moves + k).to(tl.int64)
        count = tl.where(k < num_moves, count, 0)  # programs past the count copy nothing
        for chunk in range(0, count, BLOCK):
            offsets = chunk + tl.arange(0, BLOCK)
            mask = offsets < count
            ids = tl.load(src + src_row * src_stride + offsets, mask=mask)
            tl.store(dst + dst_row * dst_stride + offsets, ids, mask=mask)

    @triton.jit(do_not_specialize=["num_tokens", "row_stride"])
    def _slot_mapping_kernel(
        rows, row_stride, positions, cu_seqlens, context_lens, out, num_tokens,
        BLOCK_SIZE: tl.constexpr, HAS_CU: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        if HAS_CU:  # program = row; its tokens are [cu[row], cu[row + 1])
            first = tl.load(cu_seqlens + pid).to(tl.int64)
            last = tl.load(cu_seqlens + pid + 1).to(tl.int64)
            for chunk in range(first, last, BLOCK):
                tokens = chunk + tl.arange(0, BLOCK)
                mask = tokens < last
                pos = tl.load(positions + tokens, mask=mask, other=0)
                block = tl.load(rows + pid * row_stride + pos // BLOCK_SIZE, mask=mask, other=0)
                slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
                tl.store(out + tokens, slot, mask=mask)
        else:  # decode: token t belongs to row t; rows with context length 0 are padding
            tokens = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = tokens < num_tokens
            valid = mask & (tl.load(context_lens + tokens, mask=mask, other=0) > 0)
            pos = tl.load(positions + tokens, mask=valid, other=0)
            block = tl.load(rows + tokens * row_stride + pos // BLOCK_SIZE, mask=valid, other=0)
            slot = tl.where(valid, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
            tl.store(out + tokens, slot, mask=mask)


def apply_row_deltas(rows: torch.Tensor, deltas: torch.Tensor, max_deltas: int) -> None:
    """rows[row_k, start_k : start_k + count_k] = the delta's block ids, for every k.

    The delta count is read on the device; the grid (`max_deltas` programs) is fixed, so
    the launch can be captured in a CUDA graph."""
    _apply_row_deltas_kernel[(max_deltas,)](rows, rows.stride(0), deltas, BLOCK=BLOCK_IDS)


def apply_row_deltas_reference(rows: torch.Tensor, deltas: torch.Tensor, max_deltas: int):
    n = int(deltas[0])
    header = deltas[1 : 3 * n + 2].tolist()
    targets, starts, offsets = header[:n], header[n : 2 * n], header[2 * n : 3 * n + 1]
    blocks = deltas[3 * n + 2 :]
    for k in range(n):
        count = offsets[k + 1] - offsets[k]
        rows[targets[k], starts[k] : starts[k] + count] = blocks[offsets[k] : offsets[k + 1]]


def move_rows(rows: torch.Tensor, scratch: torch.Tensor, moves: torch.Tensor, max_moves: int):
    """rows[destinations[k], :lengths[k]] = old rows[sources[k], :lengths[k]], for all k
    (through `scratch`, so any permutation, cycles included, is safe). The move count is
    read on the device; the two launches never change (CUDA-graph capturable)."""
    grid = (max_moves,)
    _copy_rows_kernel[grid](
        rows, rows.stride(0), scratch, scratch.stride(0), moves, GATHER=True, BLOCK=BLOCK_IDS
    )
    _copy_rows_kernel[grid](
        scratch, scratch.stride(0), rows, rows.stride(0), moves, GATHER=False, BLOCK=BLOCK_IDS
    )


def move_rows_reference(rows, scratch, moves, max_moves):
    n = int(moves[0])
    values = moves[1 : 3 * n + 1].tolist()
    sources, destinations, lengths = values[:n], values[n : 2 * n], values[2 * n :]
    for k in range(n):
        scratch[k, : lengths[k]] = rows[sources[k], : lengths[k]]
    for k in range(n):
        rows[destinations[k], : lengths[k]] = scratch[k, : lengths[k]]


def derive_slot_mapping(
    rows: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    num_tokens: int,
    num_rows: int,
    block_size: int,
) -> None:
    """out[:num_tokens] = cache slot of each token (see the module docstring).

    With cu_seqlens (prefill/mixed: num_rows rows, no padding) one program per row;
    without (decode) token t is row t and rows whose context length is 0 (padding) get -1,
    so a padded CUDA-graph batch needs no runtime count and the launch is capturable."""
    if cu_seqlens is not None:
        grid = (num_rows,)
    else:
        grid = (triton.cdiv(num_tokens, BLOCK_TOKENS),)
    if grid[0] == 0:
        return
    _slot_mapping_kernel[grid](
        rows, rows.stride(0), positions, cu_seqlens, context_lens, out, num_tokens,
        BLOCK_SIZE=block_size, HAS_CU=cu_seqlens is not None, BLOCK=BLOCK_TOKENS,
    )  # fmt: skip


def derive_slot_mapping_reference(
    rows, positions, cu_seqlens, context_lens, out, num_tokens, num_rows, block_size
) -> None:
    pos = positions[:num_tokens].long()
    if cu_seqlens is not None:
        lengths = (cu_seqlens[1 : num_rows + 1] - cu_seqlens[:num_rows]).long()
        row = torch.repeat_interleave(torch.arange(num_rows, device=rows.device), lengths)
        out[:num_tokens] = rows[row, pos // block_size].long() * block_size + pos % block_size
        return
    valid = torch.nonzero(context_lens[:num_tokens] > 0).flatten()
    out[:num_tokens] = -1
    out[valid] = rows[valid, pos[valid] // block_size].long() * block_size + pos[valid] % block_size

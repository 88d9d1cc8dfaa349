"""Device-side maintenance of the page table's mirror, and the views backends derive.

The versioned page table (atom/model_engine/page_table.py) keeps one row of KV block ids
per batch position on the device. Each step it sends only what changed:

- `apply_row_deltas`: staged `(row, start, block ids)` deltas, one int32 buffer laid out
  [rows(n) | starts(n) | offsets(n + 1) | block ids]; delta k writes
  ids[offsets[k]:offsets[k + 1]] into rows[row_k, start_k:]. Appends are one or a few ids
  per row, new rows their whole list.
- `move_rows`: rows that moved to another batch position (requests finished, preempted
  or reordered), one int32 buffer [sources(n) | destinations(n) | lengths(n)], through a
  scratch table so that any permutation (cycles included) is safe. Only the valid ids
  move, never the full row width.
- `derive_slot_mapping`: the MHA view, a cache slot per new token,
  slot = rows[row, position // block_size] * block_size + position % block_size,
  -1 for padding tokens (CUDA-graph padded decode batches).

Shapes: rows [R, W] int32 (row stride given); positions int64.
Runtime lengths (not constexpr, in do_not_specialize): num_deltas, num_moves, num_tokens,
num_rows, num_valid. Geometry (constexpr): BLOCK sizes, block_size, the HAS_CU flag.
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

    @triton.jit(do_not_specialize=["num_deltas", "row_stride"])
    def _apply_row_deltas_kernel(rows, row_stride, deltas, num_deltas, BLOCK: tl.constexpr):
        # deltas (int32): [rows(n) | starts(n) | offsets(n + 1) | block ids]
        k = tl.program_id(0)
        row = tl.load(deltas + k).to(tl.int64)
        start = tl.load(deltas + num_deltas + k).to(tl.int64)
        first = tl.load(deltas + 2 * num_deltas + k).to(tl.int64)
        count = tl.load(deltas + 2 * num_deltas + k + 1).to(tl.int64) - first
        blocks = deltas + 3 * num_deltas + 1 + first
        for chunk in range(0, count, BLOCK):
            offsets = chunk + tl.arange(0, BLOCK)
            mask = offsets < count
            ids = tl.load(blocks + offsets, mask=mask)
            tl.store(rows + row * row_stride + start + offsets, ids, mask=mask)

    @triton.jit(do_not_specialize=["num_moves", "src_stride", "dst_stride"])
    def _copy_rows_kernel(
        src, src_stride, dst, dst_stride, moves, num_moves, GATHER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # moves (int32): [sources(n) | destinations(n) | lengths(n)]
        # GATHER: scratch[k] = src[sources[k]]; else dst[destinations[k]] = scratch[k]
        k = tl.program_id(0)
        if GATHER:
            src_row = tl.load(moves + k).to(tl.int64)
            dst_row = k.to(tl.int64)
        else:
            src_row = k.to(tl.int64)
            dst_row = tl.load(moves + num_moves + k).to(tl.int64)
        count = tl.load(moves + 2 * num_moves + k).to(tl.int64)
        for chunk in range(0, count, BLOCK):
            offsets = chunk + tl.arange(0, BLOCK)
            mask = offsets < count
            ids = tl.load(src + src_row * src_stride + offsets, mask=mask)
            tl.store(dst + dst_row * dst_stride + offsets, ids, mask=mask)

    @triton.jit(do_not_specialize=["num_tokens", "num_valid", "row_stride"])
    def _slot_mapping_kernel(
        rows, row_stride, positions, cu_seqlens, out, num_tokens, num_valid,
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
        else:  # decode: token t belongs to row t; rows past num_valid are padding
            tokens = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = tokens < num_tokens
            valid = tokens < num_valid
            pos = tl.load(positions + tokens, mask=valid, other=0)
            block = tl.load(rows + tokens * row_stride + pos // BLOCK_SIZE, mask=valid, other=0)
            slot = tl.where(valid, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
            tl.store(out + tokens, slot, mask=mask)


def apply_row_deltas(rows: torch.Tensor, deltas: torch.Tensor, num_deltas: int) -> None:
    """rows[row_k, start_k : start_k + count_k] = the delta's block ids, for every k."""
    if num_deltas:
        _apply_row_deltas_kernel[(num_deltas,)](
            rows, rows.stride(0), deltas, num_deltas, BLOCK=BLOCK_IDS
        )


def apply_row_deltas_reference(rows: torch.Tensor, deltas: torch.Tensor, num_deltas: int):
    n = num_deltas
    header = deltas[: 3 * n + 1].tolist()
    targets, starts, offsets = header[:n], header[n : 2 * n], header[2 * n : 3 * n + 1]
    blocks = deltas[3 * n + 1 :]
    for k in range(n):
        count = offsets[k + 1] - offsets[k]
        rows[targets[k], starts[k] : starts[k] + count] = blocks[offsets[k] : offsets[k + 1]]


def move_rows(rows: torch.Tensor, scratch: torch.Tensor, moves: torch.Tensor, num_moves: int):
    """rows[destinations[k], :lengths[k]] = old rows[sources[k], :lengths[k]], for all k
    (through `scratch`, so any permutation, cycles included, is safe)."""
    if not num_moves:
        return
    grid = (num_moves,)
    _copy_rows_kernel[grid](
        rows, rows.stride(0), scratch, scratch.stride(0), moves, num_moves,
        GATHER=True, BLOCK=BLOCK_IDS,
    )  # fmt: skip
    _copy_rows_kernel[grid](
        scratch, scratch.stride(0), rows, rows.stride(0), moves, num_moves,
        GATHER=False, BLOCK=BLOCK_IDS,
    )  # fmt: skip


def move_rows_reference(rows, scratch, moves, num_moves):
    n = num_moves
    values = moves[: 3 * n].tolist()
    sources, destinations, lengths = values[:n], values[n : 2 * n], values[2 * n :]
    for k in range(n):
        scratch[k, : lengths[k]] = rows[sources[k], : lengths[k]]
    for k in range(n):
        rows[destinations[k], : lengths[k]] = scratch[k, : lengths[k]]


def derive_slot_mapping(
    rows: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    out: torch.Tensor,
    num_tokens: int,
    num_valid: int,
    block_size: int,
) -> None:
    """out[:num_tokens] = cache slot of each token (see the module docstring).

    With cu_seqlens (prefill/mixed) there are num_valid rows and no padding; without
    (decode) token t is row t and tokens [num_valid, num_tokens) get -1."""
    if cu_seqlens is not None:
        grid = (num_valid,)
    else:
        grid = (triton.cdiv(num_tokens, BLOCK_TOKENS),)
    if grid[0] == 0:
        return
    _slot_mapping_kernel[grid](
        rows, rows.stride(0), positions, cu_seqlens, out, num_tokens, num_valid,
        BLOCK_SIZE=block_size, HAS_CU=cu_seqlens is not None, BLOCK=BLOCK_TOKENS,
    )  # fmt: skip


def derive_slot_mapping_reference(
    rows, positions, cu_seqlens, out, num_tokens, num_valid, block_size
) -> None:
    pos = positions[:num_tokens].long()
    if cu_seqlens is not None:
        lengths = (cu_seqlens[1 : num_valid + 1] - cu_seqlens[:num_valid]).long()
        row = torch.repeat_interleave(torch.arange(num_valid, device=rows.device), lengths)
        out[:num_tokens] = rows[row, pos // block_size].long() * block_size + pos % block_size
        return
    row = torch.arange(num_valid, device=rows.device)
    valid_pos = pos[:num_valid]
    out[:num_valid] = (
        rows[row, valid_pos // block_size].long() * block_size + valid_pos % block_size
    )
    out[num_valid:num_tokens] = -1

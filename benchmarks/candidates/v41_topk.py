"""A candidate that lost to its torch reference: DeepSeek-V4.1's two-level top-k in Triton
(atom/kernels/v41_topk.py holds the references the engine runs and what they compute).

One program per query row finds the k-th largest score exactly by a bisection over the
32-bit order keys of the floats (32 counting passes over the row), takes every key above it
and the first (by index) of the keys equal to it, and compacts them in index order; level
two then writes each pick at its rank (pairwise comparisons within the k picks), level one
marks the entries of its picked blocks. Runtime lengths (do_not_specialize): the row width,
k and the row strides; geometry (constexpr): the candidate block size, tiles, the mode.
Offsets int64. Measured by `python -m benchmarks.deepseek_v41_kernels`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.platform import use_triton
from atom.kernels.v41_topk import candidate_blocks_reference, two_level_topk_reference

MODE_ENTRIES, MODE_BLOCKS = 0, 1


@triton.jit
def _order_keys(score):
    """fp32 -> int64 keys in [0, 2^32) ordered as the floats (-0.0 == 0.0, NaN on top)."""
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(score != score, 0x7FFFFFFF, key)
    return key.to(tl.int64) + 2147483648


@triton.jit
def _tile_keys(
    scores_ptr, allowed_ptr, row, items, num_items, num_entries, newest,
    stride_scores_row, stride_allowed_row,
    MODE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Keys of ``items`` (entries, or blocks of GROUP entries) and whether each may be output
    (entries: visible & candidate; blocks: a score above -inf)."""
    in_range = items < num_items
    if MODE == 0:
        score = tl.load(scores_ptr + row * stride_scores_row + items, mask=in_range, other=0.0)
        allowed = tl.load(allowed_ptr + row * stride_allowed_row + items, mask=in_range, other=0)
        allowed = allowed != 0
        score = tl.where(allowed, score, float("-inf"))
    else:
        entries = items[:, None] * GROUP + tl.arange(0, BLOCK_G)[None, :]
        mask = in_range[:, None] & (tl.arange(0, BLOCK_G) < GROUP)[None, :]
        mask = mask & (entries < num_entries)
        values = tl.load(scores_ptr + row * stride_scores_row + entries, mask=mask,
                         other=float("-inf"))  # fmt: skip
        score = tl.max(values, axis=1)
        score = tl.where(items == newest, float("inf"), score)
        allowed = score > float("-inf")
    return _order_keys(score), allowed, in_range


@triton.jit(
    do_not_specialize=[
        "num_items", "num_entries", "k", "stride_scores_row", "stride_allowed_row",
        "stride_out_row",
    ]
)  # fmt: skip
def _topk_kernel(
    scores_ptr,  # [T, num_entries] fp32
    allowed_ptr,  # [T, num_entries] bool as int8 (entries mode)
    num_visible_ptr,  # [T] int64 (blocks mode)
    out_ptr,  # entries: [T, k] int64 ids (-1 none); blocks: [T, num_entries] int8, zeroed
    scratch_keys_ptr,  # [T, k] int64
    scratch_values_ptr,  # [T, k] int64
    num_items,
    num_entries,
    k,
    stride_scores_row,
    stride_allowed_row,
    stride_out_row,
    MODE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK: tl.constexpr,
    RANK_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    zero = row * 0
    newest = zero - 1
    if MODE == 1:
        visible = tl.load(num_visible_ptr + row).to(tl.int64)
        newest = tl.where(visible > 0, (visible - 1) // GROUP, -1)
    offs = tl.arange(0, BLOCK)
    # the k-th largest key: the largest t with count(key >= t) >= k (k <= num_items)
    lo, hi = zero, zero + 4294967295
    for _ in range(32):
        mid = (lo + hi + 1) // 2
        count = tl.zeros([BLOCK], tl.int32)
        for start in range(0, num_items, BLOCK):
            keys, allowed, in_range = _tile_keys(
                scores_ptr, allowed_ptr, row, start + offs, num_items, num_entries, newest,
                stride_scores_row, stride_allowed_row, MODE, GROUP, BLOCK_G,
            )  # fmt: skip
            count += (in_range & (keys >= mid)).to(tl.int32)
        enough = tl.sum(count, axis=0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    threshold = lo
    above = tl.zeros([BLOCK], tl.int32)
    for start in range(0, num_items, BLOCK):
        keys, allowed, in_range = _tile_keys(
            scores_ptr, allowed_ptr, row, start + offs, num_items, num_entries, newest,
            stride_scores_row, stride_allowed_row, MODE, GROUP, BLOCK_G,
        )  # fmt: skip
        above += (in_range & (keys > threshold)).to(tl.int32)
    equal_needed = k - tl.sum(above, axis=0)
    # every key above the threshold and the first `equal_needed` equal to it, in index order
    equal_seen, picked = zero, zero
    for start in range(0, num_items, BLOCK):
        items = start + offs
        keys, allowed, in_range = _tile_keys(
            scores_ptr, allowed_ptr, row, items, num_items, num_entries, newest,
            stride_scores_row, stride_allowed_row, MODE, GROUP, BLOCK_G,
        )  # fmt: skip
        equal = (in_range & (keys == threshold)).to(tl.int32)
        equal_rank = equal_seen + tl.cumsum(equal, axis=0) - equal
        take = (in_range & (keys > threshold)) | ((equal != 0) & (equal_rank < equal_needed))
        taken = take.to(tl.int32)
        slot = picked + tl.cumsum(taken, axis=0) - taken
        if MODE == 0:
            values = tl.where(allowed, items, -1).to(tl.int64)
            tl.store(scratch_keys_ptr + row * k + slot, keys, mask=take)
            tl.store(scratch_values_ptr + row * k + slot, values, mask=take)
        else:  # mark the entries of every picked block that has a visible entry
            group = tl.arange(0, BLOCK_G)
            entries = items.to(tl.int64)[:, None] * GROUP + group[None, :]
            mark = (take & allowed)[:, None] & (group < GROUP)[None, :] & (entries < num_entries)
            ones = tl.full([BLOCK, BLOCK_G], 1, tl.int8)
            tl.store(out_ptr + row * stride_out_row + entries, ones, mask=mark)
        equal_seen += tl.sum(equal, axis=0)
        picked += tl.sum(taken, axis=0)
    if MODE == 0:
        tl.debug_barrier()  # the compacted picks just written are read back below
        # each pick's rank: picks with a larger key, or an equal key and a lower index
        pairs = tl.arange(0, RANK_BLOCK)
        for start in range(0, k, RANK_BLOCK):
            mine = start + pairs
            mine_keys = tl.load(scratch_keys_ptr + row * k + mine, mask=mine < k, other=0)
            rank = tl.zeros([RANK_BLOCK], tl.int32)
            for other_start in range(0, k, RANK_BLOCK):
                other = other_start + pairs
                other_keys = tl.load(scratch_keys_ptr + row * k + other, mask=other < k,
                                     other=0)  # fmt: skip
                beats = (other_keys[None, :] > mine_keys[:, None]) | (
                    (other_keys[None, :] == mine_keys[:, None]) & (other[None, :] < mine[:, None])
                )
                beats = beats & (other < k)[None, :]
                rank += tl.sum(beats.to(tl.int32), axis=1)
            values = tl.load(scratch_values_ptr + row * k + mine, mask=mine < k, other=-1)
            tl.store(out_ptr + row * stride_out_row + rank, values, mask=mine < k)


_BLOCK, _RANK_BLOCK = 512, 64  # entries per scan tile; picks per side of a rank tile


def two_level_topk(
    scores: torch.Tensor,
    visible: torch.Tensor,
    topk: int,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton `two_level_topk_reference` (same arguments, same ids in the same order)."""
    if not use_triton(scores):
        return two_level_topk_reference(scores, visible, topk, candidates)
    num_rows, width = scores.shape
    k = min(topk, width)
    out = torch.full((num_rows, k), -1, dtype=torch.int64, device=scores.device)
    if num_rows == 0 or k == 0:
        return out
    allowed = visible if candidates is None else visible & candidates
    allowed = allowed.to(torch.int8).contiguous()
    scores = scores.float()
    assert scores.stride(-1) == 1 and allowed.stride(-1) == 1
    # two allocations, not two halves of one: a half can lose the 16-byte alignment Triton
    # specializes pointers on (a new variant for odd num_rows * k)
    scratch_keys = torch.empty(num_rows, k, dtype=torch.int64, device=scores.device)
    scratch_values = torch.empty_like(scratch_keys)
    _topk_kernel[(num_rows,)](
        scores, allowed, out, out, scratch_keys, scratch_values, width, width, k,
        scores.stride(0), allowed.stride(0), out.stride(0),
        MODE=MODE_ENTRIES, GROUP=1, BLOCK_G=1, BLOCK=_BLOCK,
        RANK_BLOCK=_RANK_BLOCK,
    )  # fmt: skip
    return out


def candidate_blocks(
    scores: torch.Tensor, num_visible: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """Triton `candidate_blocks_reference` (same arguments, same mask)."""
    if not use_triton(scores):
        return candidate_blocks_reference(scores, num_visible, topk_blocks, block_size)
    num_rows, width = scores.shape
    num_blocks = -(-width // block_size)
    keep = torch.zeros(num_rows, width, dtype=torch.int8, device=scores.device)
    k = min(topk_blocks, num_blocks)
    if num_rows and k:
        scores = scores.float()
        assert scores.stride(-1) == 1
        visible = num_visible.to(torch.int64)
        block_group = triton.next_power_of_2(block_size)
        _topk_kernel[(num_rows,)](
            scores, keep, visible, keep, keep, keep, num_blocks, width, k,
            scores.stride(0), 0, keep.stride(0),
            MODE=MODE_BLOCKS, GROUP=block_size, BLOCK_G=block_group,
            BLOCK=max(16, _BLOCK // block_group), RANK_BLOCK=_RANK_BLOCK,  # 512 entries a tile
        )  # fmt: skip
    return keep.bool()

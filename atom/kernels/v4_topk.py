"""DeepSeek-V4 / V4.1 indexer top-k at decode: a select over each row's own entries.

Row b sees entries ``0 .. n_b - 1`` (``counts[b]``: for the indexer
``(positions[b] + 1) // ratio``, 0 for a padded row, capped at the scores row's width;
`visible_counts`), optionally only those ``allowed`` (V4.1's candidate blocks). The chosen
ids are the ``min(k, m_b)`` best scores among those ``m_b`` entries, ties to the lower id
(-0.0 equals 0.0; the rule of docs/architecture.md "Top-k ties", as `select_topk`'s stable
sort), written in ascending id order, -1 after them. Nothing past ``n_b`` is read: the
cost follows the sequence, not ``max_model_len`` (the scores row's width).

Triton `indexer_topk_select` (beside `indexer_topk_select_reference`): one program per row.
1. the threshold t: the largest float-order key with at least ``min(k, m_b)`` scores >= t
   (a radix select over the order-preserving bits: 4 rounds of a 256-bin histogram of the
   next 8 bits over the row's own scores; the first round also counts ``m_b``);
2. one pass in id order keeps the scores > t and the first ones equal to t, up to
   ``min(k, m_b)`` in all, and writes their ids compacted (a prefix sum): 5 passes over
   the row's scores in all.
Runtime lengths (do_not_specialize): the scores row width and k. Geometry constexpr
(CHUNK, HAS_ALLOWED). No host sync: CUDA-graph capturable.

Few long rows (batch-1 decode at 64K: one row of ~16K entries a CSA layer) leave all but one
SM idle, so `indexer_topk_select_split` shares each row among S programs (`topk_splits`
picks S from the shapes; SPLITS_OVERRIDE forces it): each round is a launch over (row,
slice) whose programs add their slice's histogram to the row's global one ([B, 4, 256]
int32, atomics) after rebuilding the prefix from the earlier rounds' histograms; a count
launch gives each slice's scores above and equal to t; the compaction places each slice's
picks after the earlier slices' (their counts prefix-summed). Same ids, same order, same
-1 padding as the single-program kernel; the split count is runtime (do_not_specialize).
"""

from __future__ import annotations

import torch

from atom.kernels.decode_attention import multi_processors

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)

# scores per step of a pass, and warps: H200 (`benchmarks.kernels --only-v4-topk`, top-512
# at 1 and 64 rows): 12.7 us at 2,048 visible entries and 77.8 at 16,384, against 16.1 and
# 106.5 with 1,024 / 4 warps (4,096 / 8: 19.3 and 67.9)
CHUNK = 2048
NUM_WARPS = 8


def visible_counts(positions, context_lens, ratio: int, width: int) -> torch.Tensor:
    """[B] int64: the entries each row may see (0 for a padded row), at most ``width``."""
    counts = ((positions.long() + 1) // ratio).clamp(max=width)
    return torch.where(context_lens > 0, counts, torch.zeros_like(counts))


def indexer_topk_select_reference(scores, counts, k: int, allowed=None) -> torch.Tensor:
    """scores ``[B, W]`` fp32, counts ``[B]``, allowed ``[B, W]`` bool or None -> ids
    ``[B, k]`` int64: each row's best ``min(k, m_b)`` entries among the first ``counts[b]``
    (and allowed) ones (ties: lower id) in ascending id order, -1 after them. A stable
    descending sort (the tie rule), then the ids sorted."""
    width = scores.shape[1]
    ids = torch.arange(width, device=scores.device)
    visible = ids[None, :] < counts[:, None]
    if allowed is not None:
        visible = visible & allowed
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices
    order = torch.nn.functional.pad(order, (0, max(0, k - width)), value=0)[:, :k]
    rank = torch.arange(k, device=scores.device)[None, :]
    chosen = torch.where(rank < visible.sum(dim=1, keepdim=True), order, width)
    chosen = chosen.sort(dim=-1).values
    return torch.where(chosen < width, chosen, -1)


@triton.jit
def _ordered_bits(value):
    """uint32 bits of a float in the float's order (-0.0 as +0.0); 0 is below every float."""
    value = tl.where(value == 0.0, 0.0, value)
    bits = value.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def _chunk_bits(scores_ptr, allowed_ptr, row, width, offset, lanes, end, HAS_ALLOWED: tl.constexpr):
    """(inside, ordered bits) of row ``row``'s entries ``offset + lanes``: inside the first
    ``end`` entries (and allowed, with HAS_ALLOWED)."""
    inside = offset + lanes < end
    if HAS_ALLOWED:
        inside &= tl.load(allowed_ptr + row * width + offset + lanes, mask=inside, other=0) != 0
    values = tl.load(scores_ptr + row * width + offset + lanes, mask=inside, other=0.0)
    return inside, _ordered_bits(values)


@triton.jit(do_not_specialize=["width", "k"])
def _indexer_topk_kernel(
    scores_ptr,  # [B, width] fp32, row-contiguous
    counts_ptr,  # [B] int: the entries row b may see (its first counts[b])
    allowed_ptr,  # [B, width] bool (read only with HAS_ALLOWED)
    out_ptr,  # [B, k] int64
    width,
    k,
    HAS_ALLOWED: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, CHUNK)
    n = tl.minimum(tl.load(counts_ptr + row).to(tl.int64), width)
    # 1. t: the largest key with at least `wanted` scores >= it, 8 bits a round from the top
    #    (a histogram of the next digit among the scores matching the digits found so far)
    bins = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.uint32)
    prefix_mask = tl.full([], 0, tl.uint32)
    wanted = tl.zeros([], tl.int64)
    remaining = tl.zeros([], tl.int64)  # how many scores matching `prefix` are still wanted
    for round_ in tl.static_range(4):
        counts = tl.zeros([256], tl.int32)
        for start in range(0, n, CHUNK):
            inside, u = _chunk_bits(scores_ptr, allowed_ptr, row, width, start, lanes, n,
                                    HAS_ALLOWED)  # fmt: skip
            match = inside & ((u & prefix_mask) == prefix)
            digits = ((u >> (24 - 8 * round_)) & 0xFF).to(tl.int32)
            counts += tl.histogram(digits, 256, mask=match)
        if round_ == 0:  # every entry matches the empty prefix: m_b
            wanted = tl.minimum(tl.sum(counts, 0).to(tl.int64), k)
            remaining = wanted
        greater = tl.sum(counts, 0) - tl.cumsum(counts, 0)  # matching scores with a larger digit
        here = (greater < remaining) & (greater + counts >= remaining)
        digit = tl.max(tl.where(here, bins, -1), 0)  # one digit (none when nothing is wanted)
        remaining -= tl.sum(tl.where(bins == digit, greater, 0), 0)
        prefix = prefix | (digit.to(tl.uint32) << (24 - 8 * round_))
        prefix_mask = prefix_mask | (tl.full([], 0xFF, tl.uint32) << (24 - 8 * round_))
    threshold = prefix
    equal_wanted = remaining  # wanted minus the scores above t: the ones equal to t to take
    # 2. those above t, then the first ones equal to t by id, compacted in id order
    taken = tl.zeros([], tl.int32)
    taken_equal = tl.zeros([], tl.int32)
    for start in range(0, n, CHUNK):
        inside, u = _chunk_bits(scores_ptr, allowed_ptr, row, width, start, lanes, n,
                                HAS_ALLOWED)  # fmt: skip
        equal = inside & (u == threshold)
        equal_rank = taken_equal + tl.cumsum(equal.to(tl.int32), 0) - 1
        keep = inside & ((u > threshold) | (equal & (equal_rank < equal_wanted)))
        slot = taken + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(out_ptr + row * k + slot, (start + lanes).to(tl.int64), mask=keep)
        taken_equal += tl.sum(equal.to(tl.int32), 0)
        taken += tl.sum(keep.to(tl.int32), 0)
    for start in range(0, k, CHUNK):  # -1 after the picks (disjoint from the slots above)
        slot = start + lanes
        tl.store(out_ptr + row * k + slot, tl.full([CHUNK], -1, tl.int64),
                 mask=(slot >= wanted) & (slot < k))  # fmt: skip


@triton.jit
def _slice_bounds(counts_ptr, row, width, split, num_splits):
    """Split ``split`` of ``num_splits`` equal runs of the row's first counts[row] entries."""
    n = tl.minimum(tl.load(counts_ptr + row).to(tl.int64), width)
    length = tl.cdiv(n, num_splits)
    start = split * length
    return start, tl.minimum(start + length, n)


@triton.jit
def _radix_state(histogram_ptr, rounds, k):
    """The radix select after ``rounds`` rounds, from one row's global histograms ([4, 256]
    int32; round 0's complete when ``rounds`` > 0): (prefix, prefix_mask, wanted,
    remaining), as `_indexer_topk_kernel` holds them after as many rounds."""
    bins = tl.arange(0, 256)
    wanted = tl.minimum(tl.sum(tl.load(histogram_ptr + bins), 0).to(tl.int64), k)
    remaining = wanted
    prefix = tl.full([], 0, tl.uint32)
    prefix_mask = tl.full([], 0, tl.uint32)
    for round_ in range(rounds):
        counts = tl.load(histogram_ptr + round_ * 256 + bins)
        shift = (tl.full([], 24, tl.int32) - 8 * round_).to(tl.uint32)
        greater = tl.sum(counts, 0) - tl.cumsum(counts, 0)
        here = (greater < remaining) & (greater + counts >= remaining)
        digit = tl.max(tl.where(here, bins, -1), 0)
        remaining -= tl.sum(tl.where(bins == digit, greater, 0), 0)
        prefix = prefix | (digit.to(tl.uint32) << shift)
        prefix_mask = prefix_mask | (tl.full([], 0xFF, tl.uint32) << shift)
    return prefix, prefix_mask, wanted, remaining


@triton.jit(do_not_specialize=["width", "k", "num_splits", "round_"])
def _topk_histogram_kernel(
    scores_ptr,  # [B, width] fp32, row-contiguous
    counts_ptr,  # [B] int: the entries row b may see
    allowed_ptr,  # [B, width] bool (read only with HAS_ALLOWED)
    histograms_ptr,  # [B, 4, 256] int32, zeroed; this launch adds to [:, round_]
    width,
    k,
    num_splits,
    round_,
    HAS_ALLOWED: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Round ``round_`` of the split radix select: program (b, s) adds its slice's
    histogram of the round's digit (among the scores matching the prefix so far, rebuilt
    from the earlier rounds' histograms) to row b's global one."""
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, CHUNK)
    start, end = _slice_bounds(counts_ptr, row, width, tl.program_id(1), num_splits)
    histogram = histograms_ptr + row * 1024
    prefix, prefix_mask, _, _ = _radix_state(histogram, round_, k)
    shift = (tl.full([], 24, tl.int32) - 8 * round_).to(tl.uint32)
    counts = tl.zeros([256], tl.int32)
    for offset in range(start, end, CHUNK):
        inside, u = _chunk_bits(scores_ptr, allowed_ptr, row, width, offset, lanes, end,
                                HAS_ALLOWED)  # fmt: skip
        match = inside & ((u & prefix_mask) == prefix)
        digits = ((u >> shift) & 0xFF).to(tl.int32)
        counts += tl.histogram(digits, 256, mask=match)
    bins = tl.arange(0, 256)
    # relaxed: the next launch reads the sums, and a kernel boundary orders them
    tl.atomic_add(histogram + round_ * 256 + bins, counts, mask=counts > 0, sem="relaxed")


@triton.jit(do_not_specialize=["width", "k", "num_splits"])
def _topk_count_kernel(
    scores_ptr,  # [B, width] fp32, row-contiguous
    counts_ptr,  # [B] int
    allowed_ptr,  # [B, width] bool (read only with HAS_ALLOWED)
    histograms_ptr,  # [B, 4, 256] int32: the 4 rounds, complete
    split_counts_ptr,  # [B, num_splits, 2] int32 out: scores > t, scores == t in the slice
    width,
    k,
    num_splits,
    HAS_ALLOWED: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lanes = tl.arange(0, CHUNK)
    start, end = _slice_bounds(counts_ptr, row, width, split, num_splits)
    threshold, _, _, _ = _radix_state(histograms_ptr + row * 1024, 4, k)
    above = tl.zeros([], tl.int32)
    equal = tl.zeros([], tl.int32)
    for offset in range(start, end, CHUNK):
        inside, u = _chunk_bits(scores_ptr, allowed_ptr, row, width, offset, lanes, end,
                                HAS_ALLOWED)  # fmt: skip
        above += tl.sum((inside & (u > threshold)).to(tl.int32), 0)
        equal += tl.sum((inside & (u == threshold)).to(tl.int32), 0)
    slot = split_counts_ptr + (row * num_splits + split) * 2
    tl.store(slot, above)
    tl.store(slot + 1, equal)


@triton.jit(do_not_specialize=["width", "k", "num_splits"])
def _topk_compact_kernel(
    scores_ptr,  # [B, width] fp32, row-contiguous
    counts_ptr,  # [B] int
    allowed_ptr,  # [B, width] bool (read only with HAS_ALLOWED)
    histograms_ptr,  # [B, 4, 256] int32: the 4 rounds, complete
    split_counts_ptr,  # [B, num_splits, 2] int32: each slice's scores > t and == t
    out_ptr,  # [B, k] int64
    width,
    k,
    num_splits,
    HAS_ALLOWED: tl.constexpr,
    CHUNK: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    """Program (b, s) writes its slice's picks (those > t, then the ties to t while their
    rank in the row stays under the ties wanted) at its offset, the earlier slices' picks,
    in id order; and its share of the -1 padding (slots >= wanted, every num_splits-th
    CHUNK from its own)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lanes = tl.arange(0, CHUNK)
    start, end = _slice_bounds(counts_ptr, row, width, split, num_splits)
    threshold, _, wanted, equal_wanted = _radix_state(histograms_ptr + row * 1024, 4, k)
    earlier = tl.arange(0, MAX_SPLITS)
    earlier_counts = split_counts_ptr + (row * num_splits + earlier) * 2
    taken_equal = tl.sum(tl.load(earlier_counts + 1, mask=earlier < split, other=0), 0)
    taken = tl.sum(tl.load(earlier_counts, mask=earlier < split, other=0), 0).to(tl.int64)
    taken += tl.minimum(taken_equal.to(tl.int64), equal_wanted)
    for offset in range(start, end, CHUNK):
        inside, u = _chunk_bits(scores_ptr, allowed_ptr, row, width, offset, lanes, end,
                                HAS_ALLOWED)  # fmt: skip
        equal = inside & (u == threshold)
        equal_rank = taken_equal + tl.cumsum(equal.to(tl.int32), 0) - 1
        keep = inside & ((u > threshold) | (equal & (equal_rank < equal_wanted)))
        slot = taken + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(out_ptr + row * k + slot, (offset + lanes).to(tl.int64), mask=keep)
        taken_equal += tl.sum(equal.to(tl.int32), 0)
        taken += tl.sum(keep.to(tl.int32), 0)
    for first in range(split * CHUNK, k, num_splits * CHUNK):  # -1 after the picks
        slot = first + lanes
        tl.store(out_ptr + row * k + slot, tl.full([CHUNK], -1, tl.int64),
                 mask=(slot >= wanted) & (slot < k))  # fmt: skip


MAX_SPLITS = 128  # the compaction's tile over the earlier slices' counts
SPLITS_OVERRIDE: int | None = None  # a fixed split count (benchmarks' A/B; 1: one program a row)
INTERPRETER_MULTI_PROCESSORS = 132  # H100/H200's count: CPU tests see the GPU's choices


SPLIT_CHUNK = 1024  # the split kernels' geometry (`benchmarks.kernels --only-v4-topk`:
SPLIT_WARPS = 4  # 1024 / 4 warps is the fastest from 16K visible entries on, one row)
SPLIT_MIN_WIDTH_CHUNKS = 8  # split only rows of 8+ chunks (8K entries, a 32K-token max_model_len)
SPLIT_MAX_ROWS_PER_SM = 1 / 8  # and only up to 1 row in 8 SMs (16 rows on 132 SMs)


def topk_splits(num_rows: int, width: int, multi_processors: int, chunk: int = SPLIT_CHUNK) -> int:
    """Programs per row for `indexer_topk_select`, from shapes only (CUDA-graph replays
    agree). ``width`` is the scores row's (max_model_len / ratio), not the visible count,
    which lives on the device.

    H200, `benchmarks.kernels --only-v4-topk`, one row: the single-program kernel takes
    12.6 us at 2K visible entries, 78 at 16K, 307 at 64K; the split kernels (six launches)
    take a floor of ~25 us whatever the count, 25.8 at 16K (16 slices of 1024) and 26.5 at
    64K (64 slices). At 64 rows the split lost at 2K visible (2.2x) and won less at 16K
    (0.67-0.97x). So: 1 (the single kernel) when a row is under SPLIT_MIN_WIDTH_CHUNKS
    chunks or the rows are more than SPLIT_MAX_ROWS_PER_SM of the SMs; else a slice per
    chunk of the width, at most MAX_SPLITS. The cost of the rule: a short sequence in an
    engine of a long max_model_len pays the split's ~25 us floor instead of ~13 us."""
    if (
        width < SPLIT_MIN_WIDTH_CHUNKS * chunk
        or num_rows > SPLIT_MAX_ROWS_PER_SM * multi_processors
    ):
        return 1
    return min(width // chunk, MAX_SPLITS)


def indexer_topk_select_split(
    scores, counts, k: int, allowed, num_splits: int, *, chunk: int = CHUNK,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:  # fmt: skip
    """`indexer_topk_select` over ``num_splits`` programs per row (1 .. MAX_SPLITS): 4
    histogram launches into a zeroed [B, 4, 256] int32, a count launch, a compaction
    launch; the same ids as the single-program kernel."""
    assert 1 <= num_splits <= MAX_SPLITS, num_splits
    assert scores.is_contiguous() and scores.dtype == torch.float32
    if allowed is not None:
        assert allowed.is_contiguous() and allowed.shape == scores.shape
    num_rows, width = scores.shape
    out = torch.empty(num_rows, k, dtype=torch.int64, device=scores.device)
    if not (num_rows and k):
        return out
    histograms = torch.zeros(num_rows, 4, 256, dtype=torch.int32, device=scores.device)
    split_counts = torch.empty(num_rows, num_splits, 2, dtype=torch.int32, device=scores.device)
    allowed_or_any = scores if allowed is None else allowed
    grid = (num_rows, num_splits)
    geometry = dict(HAS_ALLOWED=allowed is not None, CHUNK=chunk, num_warps=num_warps)
    for round_ in range(4):
        _topk_histogram_kernel[grid](
            scores, counts, allowed_or_any, histograms, width, k, num_splits, round_, **geometry
        )
    _topk_count_kernel[grid](
        scores, counts, allowed_or_any, histograms, split_counts, width, k, num_splits,
        **geometry,
    )  # fmt: skip
    _topk_compact_kernel[grid](
        scores, counts, allowed_or_any, histograms, split_counts, out, width, k, num_splits,
        MAX_SPLITS=MAX_SPLITS, **geometry,
    )  # fmt: skip
    return out


def indexer_topk_select(
    scores, counts, k: int, allowed=None, *, chunk: int = CHUNK, num_warps: int = NUM_WARPS,
    num_splits: int | None = None, split_chunk: int = SPLIT_CHUNK, split_warps: int = SPLIT_WARPS,
) -> torch.Tensor:  # fmt: skip
    """Triton `indexer_topk_select_reference` (same arguments, same result); needs Triton
    (CUDA or TRITON_INTERPRET=1). ``scores`` past a row's count are never read. ``chunk``
    and ``num_warps``: the single-program kernel's geometry, ``split_chunk`` and
    ``split_warps`` the split kernels' (`benchmarks.kernels --only-v4-topk` sweeps them).
    ``num_splits``: programs per row (None: SPLITS_OVERRIDE, else `topk_splits`; 1: the
    single-program kernel)."""
    assert scores.is_contiguous() and scores.dtype == torch.float32
    num_rows, width = scores.shape
    if allowed is not None:
        assert allowed.is_contiguous() and allowed.shape == scores.shape
    if num_splits is None:
        num_splits = SPLITS_OVERRIDE
    if num_splits is None:
        sms = INTERPRETER_MULTI_PROCESSORS
        if scores.is_cuda:
            sms = multi_processors(scores.device)
        num_splits = topk_splits(num_rows, width, sms, split_chunk)
    if num_splits > 1:
        return indexer_topk_select_split(
            scores, counts, k, allowed, num_splits, chunk=split_chunk, num_warps=split_warps
        )
    out = torch.empty(num_rows, k, dtype=torch.int64, device=scores.device)
    if num_rows and k:
        _indexer_topk_kernel[(num_rows,)](
            scores, counts, scores if allowed is None else allowed, out, width, k,
            HAS_ALLOWED=allowed is not None, CHUNK=chunk, num_warps=num_warps,
        )  # fmt: skip
    return out

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
"""

from __future__ import annotations

import torch

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
    scores = scores_ptr + row * width
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
            inside = start + lanes < n
            if HAS_ALLOWED:
                inside &= tl.load(allowed_ptr + row * width + start + lanes, mask=inside,
                                  other=0) != 0  # fmt: skip
            u = _ordered_bits(tl.load(scores + start + lanes, mask=inside, other=0.0))
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
        inside = start + lanes < n
        if HAS_ALLOWED:
            inside &= tl.load(allowed_ptr + row * width + start + lanes, mask=inside,
                              other=0) != 0  # fmt: skip
        u = _ordered_bits(tl.load(scores + start + lanes, mask=inside, other=0.0))
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


def indexer_topk_select(
    scores, counts, k: int, allowed=None, *, chunk: int = CHUNK, num_warps: int = NUM_WARPS
) -> torch.Tensor:
    """Triton `indexer_topk_select_reference` (same arguments, same result); needs Triton
    (CUDA or TRITON_INTERPRET=1). ``scores`` past a row's count are never read. ``chunk``
    and ``num_warps``: the launch's geometry (`benchmarks.kernels --only-v4-topk` sweeps
    them)."""
    assert scores.is_contiguous() and scores.dtype == torch.float32
    num_rows, width = scores.shape
    out = torch.empty(num_rows, k, dtype=torch.int64, device=scores.device)
    if allowed is not None:
        assert allowed.is_contiguous() and allowed.shape == scores.shape
    if num_rows and k:
        _indexer_topk_kernel[(num_rows,)](
            scores, counts, scores if allowed is None else allowed, out, width, k,
            HAS_ALLOWED=allowed is not None, CHUNK=chunk, num_warps=num_warps,
        )  # fmt: skip
    return out

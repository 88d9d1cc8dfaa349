"""The top k raw logits of a row and its log-sum-exp from the sampling pass's statistics.

The sampling pass (atom/kernels/sampling.py, `_sampling_pass_kernel` with STATS) reads each
logits row once and leaves, per row: every block's max and sum of exponentials, and the
max of every sub-block of SUB consecutive logits (`LogitStats`). `select_topk` finishes in
one program per row, reading only those statistics and a few sub-blocks of logits:

1. the log-sum-exp, from the block statistics;
2. a threshold t: the k-th largest sub-block max, counted with multiplicity (a radix select
   over the order-preserving bits of the sub-block maxima, 32 rounds of counting). At least
   k sub-blocks hold a value >= t, so the row's top k values are all >= t;
3. the candidate sub-blocks: those whose max is > t (fewer than k of them) and the first k
   (by index) whose max equals t (a later one only holds values tied with earlier ones, and
   ties go to the lower index). So at most 2k - 1 sub-blocks: KMAX = 32, CAPACITY = 64;
4. their logits as int64 keys (the order-preserving bits of the value high, 2^32 - 1 -
   index low: distinct, and the largest keys are the top values with ties to the lower
   index), and k rounds of "the largest key below the previous one".

The result is exactly a stable descending sort's first k (values and ids), -inf logits
included; NaN logits are not supported, -0.0 counts as +0.0, k <= the vocabulary size.
Nothing sorts the vocabulary and no step is repeated over it.

Runtime lengths (do_not_specialize): vocab_size, logits_stride, num_blocks, sub_width, k.
Geometry (constexpr): SUB, CHUNK, CAPACITY. Offsets are int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: keep the module importable for the references
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f), cdiv=None)
    tl = SimpleNamespace(constexpr=None)

SUB = 32  # logits per sub-block (the pass's BLOCK is a multiple)
KMAX = 32  # the largest k the kernel takes (larger: the torch reference)
CAPACITY = 2 * KMAX  # candidate sub-blocks: < k above the threshold + k at it
CHUNK = 4096  # sub-block maxima per step of the threshold's rounds
NUM_WARPS = 4


@dataclass
class LogitStats:
    """What the sampling pass leaves for `select_topk`, one row per pass row."""

    block_max: torch.Tensor  # [rows, num_blocks] f32
    block_sum: torch.Tensor  # [rows, num_blocks] f32: sum of exp(x - block max)
    sub_max: torch.Tensor  # [rows, cdiv(vocab, SUB)] f32


@triton.jit
def _order_key(value, index):
    """int64 keys ordered as (value, -index): value's bits made monotone (negative floats
    flip their magnitude bits) in the high half, 2^32 - 1 - index in the low half."""
    value = tl.where(value == 0.0, 0.0, value)  # -0.0 ties with +0.0
    bits = value.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    return ((ordered + 1) << 32) - 1 - index


@triton.jit
def _ordered_u32(value):
    """uint32 bits of a float in the float's order (-0.0 as +0.0); 0 is below every float."""
    value = tl.where(value == 0.0, 0.0, value)
    bits = value.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit(do_not_specialize=["logits_stride", "vocab_size", "num_blocks", "sub_width", "k"])
def _select_topk_kernel(
    logits_ptr,
    logits_stride,
    logit_rows_ptr,  # [R]: the logits row of program i
    stat_rows_ptr,  # [R]: its row of the statistics
    block_max_ptr,
    block_sum_ptr,
    sub_max_ptr,
    scratch_ptr,  # [R, CAPACITY] int32: the candidate sub-blocks
    lse_ptr,
    values_ptr,
    ids_ptr,
    vocab_size,
    num_blocks,
    sub_width,
    k,
    SUB: tl.constexpr,
    CHUNK: tl.constexpr,
    CAPACITY: tl.constexpr,
):
    """lse [R] f32, values [R, k] f32 (raw logits), ids [R, k] int64, best first."""
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(logit_rows_ptr + i).to(tl.int64)
    stat = tl.load(stat_rows_ptr + i).to(tl.int64)
    lanes = tl.arange(0, CHUNK)
    # 1. log-sum-exp from the blocks' (max, sum of exp)
    acc = tl.full([CHUNK], float("-inf"), tl.float32)
    for start in range(0, num_blocks, CHUNK):
        m = tl.load(block_max_ptr + stat * num_blocks + start + lanes, mask=start + lanes < num_blocks, other=float("-inf"))  # fmt: skip
        acc = tl.maximum(acc, m)
    best = tl.max(acc, 0)
    total = tl.zeros([CHUNK], tl.float32)
    for start in range(0, num_blocks, CHUNK):
        inside = start + lanes < num_blocks
        m = tl.load(block_max_ptr + stat * num_blocks + start + lanes, mask=inside, other=float("-inf"))  # fmt: skip
        s = tl.load(block_sum_ptr + stat * num_blocks + start + lanes, mask=inside, other=0.0)
        total += tl.where(m > float("-inf"), s * tl.exp(m - best), 0.0)
    tl.store(lse_ptr + i, best + tl.log(tl.sum(total, 0)))
    # 2. t: the largest key with at least k sub-block maxima >= it (0 if fewer than k)
    subs = sub_max_ptr + stat * sub_width
    threshold = tl.full([], 0, tl.uint32)
    bit = tl.full([], 0x80000000, tl.uint32)
    for _ in range(32):  # from the highest bit: keep it if k maxima are still >= the key
        candidate = threshold | bit
        bit = bit >> 1
        count = tl.zeros([CHUNK], tl.int32)
        for start in range(0, sub_width, CHUNK):
            inside = start + lanes < sub_width
            u = _ordered_u32(tl.load(subs + start + lanes, mask=inside, other=0.0))
            count += (inside & (u >= candidate)).to(tl.int32)
        if tl.sum(count, 0) >= k:
            threshold = candidate
    # 3. the candidate sub-blocks, in index order, into the scratch row
    taken_equal = tl.zeros([], tl.int32)
    taken = tl.zeros([], tl.int32)
    scratch = scratch_ptr + i * CAPACITY
    for start in range(0, sub_width, CHUNK):
        inside = start + lanes < sub_width
        u = _ordered_u32(tl.load(subs + start + lanes, mask=inside, other=0.0))
        equal = inside & (u == threshold)
        equal_rank = taken_equal + tl.cumsum(equal.to(tl.int32), 0) - 1
        keep = inside & ((u > threshold) | (equal & (equal_rank < k)))
        position = taken + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(scratch + position, start + lanes, mask=keep & (position < CAPACITY))
        taken_equal += tl.sum(equal.to(tl.int32), 0)
        taken += tl.sum(keep.to(tl.int32), 0)
    tl.debug_barrier()  # the scratch row, written by other threads of this program
    # 4. their logits as keys, and k rounds of the largest key below the last one
    slots = tl.arange(0, CAPACITY)
    sub = tl.load(scratch + slots, mask=slots < taken, other=0).to(tl.int64)
    index = sub[:, None] * SUB + tl.arange(0, SUB)[None, :]
    valid = (slots < taken)[:, None] & (index < vocab_size)
    x = tl.load(logits_ptr + row * logits_stride + index, mask=valid, other=0.0).to(tl.float32)
    smallest = tl.full([CAPACITY, SUB], -1, tl.int64) << 63
    keys = tl.where(valid, _order_key(x, index), smallest)
    previous = -(tl.min(tl.min(smallest, 1), 0) + 1)  # the largest int64
    for j in range(k):
        below = tl.where(keys < previous, keys, smallest)
        previous = tl.max(tl.max(below, 1), 0)
        high = previous >> 32
        bits = high.to(tl.int32)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        tl.store(values_ptr + i * k + j, bits.to(tl.float32, bitcast=True))
        tl.store(ids_ptr + i * k + j, ((high + 1) << 32) - 1 - previous)


def select_topk(logits: torch.Tensor, logit_rows: torch.Tensor, stats: LogitStats, stat_rows: torch.Tensor, k: int):  # fmt: skip
    """(lse [R] f32, top values [R, k] f32, top ids [R, k] int64) of logits rows
    `logit_rows` [R], from their statistics rows `stat_rows` [R] (see the module
    docstring). Needs Triton (CUDA or TRITON_INTERPRET=1) and 0 < k <= KMAX."""
    if not 0 < k <= KMAX:
        raise ValueError(f"select_topk: k = {k}, the kernel takes 1..{KMAX}")
    rows = logit_rows.shape[0]
    device = logits.device
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    values = torch.empty(rows, k, dtype=torch.float32, device=device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=device)
    if rows:
        scratch = torch.empty(rows, CAPACITY, dtype=torch.int32, device=device)
        _select_topk_kernel[(rows,)](
            logits, logits.stride(0), logit_rows, stat_rows,
            stats.block_max, stats.block_sum, stats.sub_max, scratch, lse, values, ids,
            logits.shape[1], stats.block_max.shape[1], stats.sub_max.shape[1], k,
            SUB=SUB, CHUNK=CHUNK, CAPACITY=CAPACITY, num_warps=NUM_WARPS,
        )  # fmt: skip
    return lse, values, ids


def log_sum_exp(block_max: torch.Tensor, block_sum: torch.Tensor) -> torch.Tensor:
    """[R] from each block's max and sum of exp(x - max)."""
    best = block_max.max(dim=1, keepdim=True).values
    return (best + (block_sum * (block_max - best).exp()).sum(1, keepdim=True).log()).squeeze(1)


def topk_lower_index_reference(logits: torch.Tensor, row_ids: torch.Tensor, k: int):
    """The same outputs from a stable descending sort of the fp32 rows (ties: lower index)."""
    raw = logits[row_ids.long()].float()
    values, ids = raw.sort(dim=1, descending=True, stable=True)
    return raw.logsumexp(dim=1), values[:, :k], ids[:, :k]

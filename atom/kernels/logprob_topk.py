"""Top-k log-probability candidates by threshold filtering (an alternative to the k rounds
of `_logprob_candidates_kernel` in atom/kernels/sampling.py; chosen there by a switch).

One program per (row, block of BLOCK logits), as the rounds kernel, but instead of k rounds
of (max, first index, mask) over the whole block:

1. the block's max and sum of exponentials (log-softmax statistics), and the max of each
   sub-block of SUB_BLOCK logits;
2. a threshold t: the k-th largest (distinct, or with COUNT_THRESHOLD counted with
   multiplicity) sub-block max. k different sub-blocks hold a value >= t, so the block's
   top k (and every value tied with its k-th) are >= t;
3. the logits >= t (typically ~k + a few: 28 on average for k = 20 over random bf16
   logits) written, in index order, as sortable int64 keys into CAPACITY slots of the
   block; unused slots get the smallest key. A block with more than CAPACITY candidates,
   or with fewer than k finite logits (t = -inf), falls back to the k rounds for itself.

The merge takes the k largest of the [R, blocks * CAPACITY] keys (`_merge_keys_kernel`,
one launch with the log-sum-exp; or `torch.topk`): a key is the order-preserving integer
of the value in its high 32 bits and (2^32 - 1 - index) in its low 32 bits, so keys are
distinct and the largest k are the top k values with ties to the lower index - the same ids as a stable descending sort of the row, -inf entries included
(NaN logits excluded; -0.0 counts as +0.0; k <= vocabulary size).

Runtime lengths (do_not_specialize): vocab_size, logits_stride, num_blocks, k.
Geometry (constexpr): BLOCK, SUB_BLOCK, CAPACITY, COUNT_THRESHOLD. Offsets are int64.
"""

from __future__ import annotations

import torch

from atom.kernels import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: keep the module importable for the references
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f), cdiv=None)
    tl = SimpleNamespace(constexpr=None)

BLOCK = 4096
SUB_BLOCK = 32  # 128 sub-blocks per block: the threshold sits close to the k-th value
CAPACITY = 64  # candidate slots per block (k <= CAPACITY; more candidates: the rounds)
# The threshold by k reductions over the sub-block maxima (False) or by ranking all pairs of
# them (True: two reductions over [BLOCK / SUB_BLOCK]^2); and the kernel's warps. Defaults
# until the H200 breakdown (python -m atom.benchmarks.sampler --breakdown) measures them.
COUNT_THRESHOLD = False
NUM_WARPS = 8  # 87 registers a thread on sm_90 (4 warps: 168)


@triton.jit
def _order_key(value, index):
    """int64 keys ordered as (value, -index): value's bits made monotone (negative floats
    flip their magnitude bits) in the high half, 2^32 - 1 - index in the low half."""
    value = tl.where(value == 0.0, 0.0, value)  # -0.0 ties with +0.0
    bits = value.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    return ((ordered + 1) << 32) - 1 - index


@triton.jit(do_not_specialize=["vocab_size", "logits_stride", "num_blocks", "k"])
def _logprob_candidates_filtered_kernel(
    logits_ptr,
    logits_stride,
    row_ids_ptr,
    block_max_ptr,
    block_sum_ptr,
    keys_ptr,
    vocab_size,
    num_blocks,
    k,
    BLOCK: tl.constexpr,
    SUB_BLOCK: tl.constexpr,
    CAPACITY: tl.constexpr,
    COUNT_THRESHOLD: tl.constexpr,
):
    """logits [S, V] (any float dtype, unit stride in V), row_ids [R] -> block_max,
    block_sum [R, num_blocks] f32, keys [R, num_blocks, CAPACITY] int64. Grid (R, blocks)."""
    i = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    row = tl.load(row_ids_ptr + i).to(tl.int64)
    # int32 positions in the block (registers: 4096 int64 offsets would double them); the
    # block's int64 start is added where a vocabulary index is formed
    start = block.to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < vocab_size - block * BLOCK
    x = tl.load(logits_ptr + row * logits_stride + start + offs, mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    best = tl.max(x, 0)
    # finite lanes only: a block of -inf logits has sum 0 (not exp(nan))
    total = tl.sum(tl.where(x > float("-inf"), tl.exp(x - best), 0.0), 0)
    slot = i * num_blocks + block
    tl.store(block_max_ptr + slot, best)
    tl.store(block_sum_ptr + slot, total)
    if k > 0:
        out = keys_ptr + slot * CAPACITY
        lanes = tl.arange(0, CAPACITY)
        smallest = tl.full([CAPACITY], -1, tl.int64) << 63
        sub_max = tl.max(tl.reshape(x, (BLOCK // SUB_BLOCK, SUB_BLOCK)), 1)
        if COUNT_THRESHOLD:  # the k-th largest sub-block max: compare all pairs, 2 reductions
            above = tl.expand_dims(sub_max, 0) >= tl.expand_dims(sub_max, 1)  # [c, s]: s >= c
            ranks = tl.sum(above.to(tl.int32), 1)
            threshold = tl.max(tl.where(ranks >= k, sub_max, float("-inf")), 0)
        else:  # the k-th largest distinct sub-block max: k reductions
            threshold = best
            for _ in range(k):
                threshold = tl.max(sub_max, 0)
                sub_max = tl.where(sub_max == threshold, float("-inf"), sub_max)
        keep = (x >= threshold) & mask
        count = tl.sum(keep.to(tl.int32), 0)
        if (threshold > float("-inf")) & (count <= CAPACITY):
            position = tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(out + position, _order_key(x, start + offs), mask=keep)
            tl.store(out + lanes, smallest, mask=lanes >= count)
        else:  # many ties or few finite logits: k rounds, as _logprob_candidates_kernel,
            # with the winners kept apart (a -inf winner must not win again)
            taken = offs < 0
            for j in range(k):
                value = tl.max(tl.where(taken, float("-inf"), x), 0)
                index = tl.min(tl.where((x == value) & mask & ~taken, offs, BLOCK), 0)
                key = _order_key(value, start + index)
                # fewer than k lanes in the block: the smallest key for the rest
                tl.store(out + j, tl.where(index < BLOCK, key, tl.min(smallest, 0)))
                taken = taken | (offs == index)
            tl.store(out + lanes, smallest, mask=lanes >= k)


@triton.jit(do_not_specialize=["num_blocks", "width", "k"])
def _merge_keys_kernel(
    block_max_ptr,
    block_sum_ptr,
    keys_ptr,
    lse_ptr,
    values_ptr,
    ids_ptr,
    num_blocks,
    width,
    k,
    CHUNK: tl.constexpr,
):
    """One program per row: block_max, block_sum [R, num_blocks] f32, keys [R, width] int64
    (distinct) -> lse [R] f32, values [R, k] f32, ids [R, k] int64. Round j takes the largest
    key below round j - 1's: nothing is written back, no key is taken twice."""
    i = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, CHUNK)
    acc = tl.full([CHUNK], float("-inf"), tl.float32)
    for start in range(0, num_blocks, CHUNK):
        index = start + lanes
        m = tl.load(block_max_ptr + i * num_blocks + index, mask=index < num_blocks, other=float("-inf"))  # fmt: skip
        acc = tl.maximum(acc, m)
    best = tl.max(acc, 0)
    total = tl.zeros([CHUNK], tl.float32)
    for start in range(0, num_blocks, CHUNK):
        index = start + lanes
        inside = index < num_blocks
        m = tl.load(block_max_ptr + i * num_blocks + index, mask=inside, other=float("-inf"))
        block_sum = tl.load(block_sum_ptr + i * num_blocks + index, mask=inside, other=0.0)
        total += tl.where(m > float("-inf"), block_sum * tl.exp(m - best), 0.0)
    tl.store(lse_ptr + i, best + tl.log(tl.sum(total, 0)))
    smallest = tl.full([CHUNK], -1, tl.int64) << 63
    previous = tl.max(-(smallest + 1), 0)  # the largest int64
    for j in range(k):
        acc_key = smallest
        for start in range(0, width, CHUNK):
            index = start + lanes
            key = tl.load(keys_ptr + i * width + index, mask=index < width, other=-1)
            key = tl.where((index < width) & (key < previous), key, smallest)
            acc_key = tl.maximum(acc_key, key)
        previous = tl.max(acc_key, 0)
        high = previous >> 32
        token = ((high + 1) << 32) - 1 - previous
        bits = high.to(tl.int32)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        tl.store(values_ptr + i * k + j, bits.to(tl.float32, bitcast=True))
        tl.store(ids_ptr + i * k + j, token)


def filtered_block_candidates(
    logits: torch.Tensor,
    row_ids: torch.Tensor,
    k: int,
    sub_block: int = SUB_BLOCK,
    capacity: int = CAPACITY,
    count_threshold: bool = COUNT_THRESHOLD,
    num_warps: int = NUM_WARPS,
):
    """The kernel alone: (block_max, block_sum [R, blocks] f32, keys [R, blocks * capacity]
    int64). Needs Triton (CUDA or TRITON_INTERPRET=1) and k <= capacity."""
    if k > capacity:
        raise ValueError(f"filtered logprob candidates: k = {k} > capacity {capacity} slots")
    vocab = logits.shape[1]
    rows = row_ids.shape[0]
    num_blocks = triton.cdiv(vocab, BLOCK)
    device = logits.device
    block_max = torch.empty(rows, num_blocks, dtype=torch.float32, device=device)
    block_sum = torch.empty_like(block_max)
    keys = torch.empty(rows, num_blocks * capacity, dtype=torch.int64, device=device)
    if rows:
        _logprob_candidates_filtered_kernel[(rows, num_blocks)](
            logits, logits.stride(0), row_ids, block_max, block_sum, keys,
            vocab, num_blocks, k, BLOCK=BLOCK, SUB_BLOCK=sub_block, CAPACITY=capacity,
            COUNT_THRESHOLD=count_threshold, num_warps=num_warps,
        )  # fmt: skip
    return block_max, block_sum, keys


def merge_keys(keys: torch.Tensor, k: int):
    """keys [R, N] int64 -> (top values [R, k] f32, top ids [R, k] int64), best first."""
    top = keys.topk(k, dim=1).values
    high = (top >> 32).to(torch.int32)
    values = torch.where(high < 0, high ^ 0x7FFFFFFF, high).view(torch.float32)
    return values, 0xFFFFFFFF - (top & 0xFFFFFFFF)


def merge_keys_triton(block_max, block_sum, keys, k: int, chunk: int = 1024):
    """`_merge_keys_kernel`: (lse [R], values [R, k], ids [R, k]) in one launch."""
    rows = keys.shape[0]
    lse = torch.empty(rows, dtype=torch.float32, device=keys.device)
    # at least one column: Triton refuses the null pointer of an empty CUDA tensor (k = 0)
    values = torch.empty(rows, max(k, 1), dtype=torch.float32, device=keys.device)
    ids = torch.empty(rows, max(k, 1), dtype=torch.int64, device=keys.device)
    if rows:
        _merge_keys_kernel[(rows,)](
            block_max, block_sum, keys, lse, values, ids,
            block_max.shape[1], keys.shape[1], k, CHUNK=chunk,
        )  # fmt: skip
    return lse, values[:, :k], ids[:, :k]


def log_sum_exp(block_max: torch.Tensor, block_sum: torch.Tensor) -> torch.Tensor:
    """[R] from each block's max and sum of exp(x - max)."""
    best = block_max.max(dim=1, keepdim=True).values
    return (best + (block_sum * (block_max - best).exp()).sum(1, keepdim=True).log()).squeeze(1)


def logprob_candidates_filtered(
    logits: torch.Tensor,
    row_ids: torch.Tensor,
    k: int,
    sub_block: int = SUB_BLOCK,
    capacity: int = CAPACITY,
    merge: str = "triton",
    count_threshold: bool = COUNT_THRESHOLD,
    num_warps: int = NUM_WARPS,
):
    """Raw logits [S, V], rows [R] -> (log-sum-exp [R] f32, top values [R, k] f32, top ids
    [R, k] int64), best first, ties to the lower index. `merge`: "triton" (one launch:
    `_merge_keys_kernel`) or "torch" (torch.topk of the keys + a few elementwise ops)."""
    if not use_triton(logits):
        return topk_lower_index_reference(logits, row_ids, k)
    block_max, block_sum, keys = filtered_block_candidates(
        logits, row_ids, k, sub_block, capacity, count_threshold, num_warps
    )
    if merge == "triton":
        return merge_keys_triton(block_max, block_sum, keys, k)
    values, ids = merge_keys(keys, k)
    return log_sum_exp(block_max, block_sum), values, ids


def topk_lower_index_reference(logits: torch.Tensor, row_ids: torch.Tensor, k: int):
    """The same outputs from a stable descending sort of the fp32 rows (ties: lower index)."""
    raw = logits[row_ids.long()].float()
    values, ids = raw.sort(dim=1, descending=True, stable=True)
    return raw.logsumexp(dim=1), values[:, :k], ids[:, :k]

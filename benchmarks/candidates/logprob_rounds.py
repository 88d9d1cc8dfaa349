"""A logprob-candidates method that lost to atom/kernels/sampling.py's `select` (the top k
from the sampling pass's statistics): k rounds of (max, first index of the max) per block
of the vocabulary, merged by torch.topk. Kept beside the benchmarks as a candidate
(`python -m benchmarks.sampler --breakdown` measures it against `select`); the figures are
in docs/benchmarks.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels import logprob_topk
from atom.kernels.sampling import BLOCK


@triton.jit(do_not_specialize=["vocab_size", "logits_stride", "num_blocks", "k"])
def _logprob_candidates_kernel(
    logits_ptr,
    logits_stride,
    row_ids_ptr,
    block_max_ptr,
    block_sum_ptr,
    top_values_ptr,
    top_ids_ptr,
    vocab_size,
    num_blocks,
    k,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    row = tl.load(row_ids_ptr + i).to(tl.int64)
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    best = tl.max(x, 0)
    # finite lanes only: a block of -inf logits has sum 0 (not exp(nan))
    total = tl.sum(tl.where(x > float("-inf"), tl.exp(x - best), 0.0), 0)
    slot = i * num_blocks + block
    tl.store(block_max_ptr + slot, best)
    tl.store(block_sum_ptr + slot, total)
    out = slot * k
    for j in range(k):  # k rounds of (max, first index of the max), masking each winner
        value = tl.max(x, 0)
        index = tl.min(tl.where((x == value) & mask, offs, vocab_size), 0)
        index = tl.minimum(index, vocab_size - 1)
        tl.store(top_values_ptr + out + j, value)
        tl.store(top_ids_ptr + out + j, index)
        x = tl.where(offs == index, float("-inf"), x)


def block_candidates(logits: torch.Tensor, row_ids: torch.Tensor, k: int, num_warps: int | None = None):  # fmt: skip
    """`_logprob_candidates_kernel` alone: (block_max, block_sum [R, blocks] f32, top values
    [R, blocks * k] f32, top ids [R, blocks * k] int64; at least one column). `num_warps`:
    Triton's default (4) unless given (the benchmark's breakdown tries 8)."""
    vocab = logits.shape[1]
    rows = row_ids.shape[0]
    num_blocks = triton.cdiv(vocab, BLOCK)
    device = logits.device
    block_max = torch.empty(rows, num_blocks, dtype=torch.float32, device=device)
    block_sum = torch.empty_like(block_max)
    # at least one column: Triton refuses the null pointer of an empty CUDA tensor (k = 0)
    width = max(num_blocks * k, 1)
    top_values = torch.empty(rows, width, dtype=torch.float32, device=device)
    top_ids = torch.empty(rows, width, dtype=torch.int64, device=device)
    if rows:
        _logprob_candidates_kernel[(rows, num_blocks)](
            logits, logits.stride(0), row_ids, block_max, block_sum, top_values, top_ids,
            vocab, num_blocks, k, BLOCK=BLOCK, **({"num_warps": num_warps} if num_warps else {}),
        )  # fmt: skip
    return block_max, block_sum, top_values, top_ids


def merge_block_candidates(block_max, block_sum, top_values, top_ids, k: int):
    """The [R, blocks] statistics and candidates of `block_candidates` -> its outputs."""
    lse = logprob_topk.log_sum_exp(block_max, block_sum)
    values, order = top_values[:, : block_max.shape[1] * k].topk(k, dim=1)
    return lse, values, top_ids.gather(1, order)


def rounds_candidates(logits: torch.Tensor, row_ids: torch.Tensor, k: int):
    """`sampling.logprob_candidates`'s outputs by k rounds of max per block."""
    return merge_block_candidates(*block_candidates(logits, row_ids, k), k)

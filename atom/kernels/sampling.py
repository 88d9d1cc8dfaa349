"""Sampling options and log-probabilities in few passes over the logits [S, V].

`apply_sampling_options`: ONE pass applying logit_bias, min_tokens masking and vLLM's
repetition / frequency / presence penalties, reading each row's state from device tensors
owned by `SamplingState` (atom/model_engine/sampling_state.py):

    counts      [R, V] int32   output-token counts of state row r; bit 30 (PROMPT_FLAG) set
                               where the token occurs in the prompt
    row_floats  [R, 3] f32     presence, frequency, repetition
    row_ints    [R, 4] int32   min_tokens, output tokens so far, bias entries, stop ids
    bias_tokens [R, Wb] int32, bias_values [R, Wb] f32, stop_ids [R, Ws] int32

    x = logits + bias (then -inf at the stop ids while output tokens < min_tokens)
    x = where(seen, x > 0 ? x / repetition : x * repetition, x)   seen: prompt or output
    x -= frequency * count ; x -= presence * (count > 0)

`greedy_with_sampling_options`: the same pass, keeping each block's maximum and its first
index instead of writing the logits (all-greedy steps without a grammar).

`logprob_candidates`: log-softmax statistics (per-block max and sum of
exponentials) and each block's top k of the RAW logits in one pass, merged on [S, blocks];
`count_greater`: the sampled token's rank (how many logits exceed its own), one pass.
Nothing sorts the vocabulary. `CANDIDATES` (ATOM_LOGPROB_CANDIDATES) picks the top-k
method: these k rounds per block, or atom/kernels/logprob_topk.py's threshold filtering.

Runtime lengths (do_not_specialize): vocab_size, the table widths, k, num_blocks, strides.
Geometry (constexpr): BLOCK. Row counts come from the grid. Offsets are int64.
"""

from __future__ import annotations

import os

import torch

from atom.kernels import logprob_topk, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: keep the module importable for the references
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f), cdiv=None)
    tl = SimpleNamespace(constexpr=None)

PROMPT_FLAG = 1 << 30  # in counts: the token occurs in the prompt
COUNT_MASK = PROMPT_FLAG - 1
BLOCK = 4096
# How logprob_candidates finds the top k on the device (see its docstring); "rounds" until
# the H200 comparison (python -m atom.benchmarks.sampler --breakdown) picks another.
CANDIDATE_METHODS = ("rounds", "filtered", "filtered_torch_merge", "torch")
CANDIDATES = os.environ.get("ATOM_LOGPROB_CANDIDATES", "rounds")


class CandidateMethodError(ValueError):
    """An unknown logprob-candidates method (argument or ATOM_LOGPROB_CANDIDATES)."""


@triton.jit(do_not_specialize=["vocab_size", "bias_width", "stop_width", "logits_stride"])
def _sampling_options_kernel(
    logits_ptr,
    logits_stride,
    out_ptr,
    state_rows_ptr,
    counts_ptr,
    row_floats_ptr,
    row_ints_ptr,
    bias_tokens_ptr,
    bias_values_ptr,
    bias_width,
    stop_ids_ptr,
    stop_width,
    vocab_size,
    block_max_ptr,
    block_arg_ptr,
    BLOCK: tl.constexpr,
    GREEDY: tl.constexpr,  # store each block's (max, first argmax) instead of the logits
):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=mask, other=0.0).to(tl.float32)
    state = tl.load(state_rows_ptr + row).to(tl.int64)
    presence = tl.load(row_floats_ptr + state * 3)
    frequency = tl.load(row_floats_ptr + state * 3 + 1)
    repetition = tl.load(row_floats_ptr + state * 3 + 2)
    min_tokens = tl.load(row_ints_ptr + state * 4)
    num_output = tl.load(row_ints_ptr + state * 4 + 1)
    num_bias = tl.load(row_ints_ptr + state * 4 + 2)
    num_stop = tl.load(row_ints_ptr + state * 4 + 3)
    for j in range(num_bias):  # a few entries per row: compare, no scatter
        token = tl.load(bias_tokens_ptr + state * bias_width + j)
        value = tl.load(bias_values_ptr + state * bias_width + j)
        x = tl.where(offs == token, x + value, x)
    if num_output < min_tokens:
        for j in range(num_stop):
            token = tl.load(stop_ids_ptr + state * stop_width + j)
            x = tl.where(offs == token, float("-inf"), x)
    counts = tl.load(counts_ptr + state * vocab_size + offs, mask=mask, other=0)
    output = (counts & 0x3FFFFFFF).to(tl.float32)
    seen = (counts >= 0x40000000) | (output > 0)
    penalised = tl.where(x > 0, x / repetition, x * repetition)
    x = tl.where(seen, penalised, x)
    x = x - frequency * output
    x = x - tl.where(output > 0, presence, 0.0)
    if GREEDY:
        x = tl.where(mask, x, float("-inf"))
        best = tl.max(x, 0)
        index = tl.min(tl.where((x == best) & mask, offs, vocab_size), 0)
        slot = row * tl.num_programs(1) + block
        tl.store(block_max_ptr + slot, best)
        tl.store(block_arg_ptr + slot, tl.minimum(index, vocab_size - 1))
    else:
        tl.store(out_ptr + row * vocab_size + offs, x, mask=mask)


def apply_sampling_options(logits, state_rows, counts, row_floats, row_ints, bias_tokens, bias_values, stop_ids):  # fmt: skip
    """logits [S, V] (any float dtype, unit stride in V), state_rows [S] int32 -> new
    float32 [S, V] with the options applied (see the module docstring)."""
    if not use_triton(logits):
        return apply_sampling_options_reference(
            logits, state_rows, counts, row_floats, row_ints, bias_tokens, bias_values, stop_ids
        )
    rows, vocab = logits.shape
    out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out
    grid = (rows, triton.cdiv(vocab, BLOCK))
    _sampling_options_kernel[grid](
        logits, logits.stride(0), out, state_rows, counts, row_floats, row_ints,
        bias_tokens, bias_values, bias_tokens.shape[1], stop_ids, stop_ids.shape[1], vocab,
        out, out, BLOCK=BLOCK, GREEDY=False,
    )  # fmt: skip
    return out


def greedy_with_sampling_options(logits, state_rows, counts, row_floats, row_ints, bias_tokens, bias_values, stop_ids):  # fmt: skip
    """argmax [S] int64 (first index of the maximum) of the logits with the options applied,
    without writing them: each block's (max, argmax), then a merge over [S, blocks]."""
    if not use_triton(logits):
        return apply_sampling_options_reference(
            logits, state_rows, counts, row_floats, row_ints, bias_tokens, bias_values, stop_ids
        ).argmax(dim=-1)
    rows, vocab = logits.shape
    num_blocks = triton.cdiv(vocab, BLOCK)
    block_max = torch.empty(rows, num_blocks, dtype=torch.float32, device=logits.device)
    block_arg = torch.empty(rows, num_blocks, dtype=torch.int64, device=logits.device)
    if rows:
        _sampling_options_kernel[(rows, num_blocks)](
            logits, logits.stride(0), block_max, state_rows, counts, row_floats, row_ints,
            bias_tokens, bias_values, bias_tokens.shape[1], stop_ids, stop_ids.shape[1], vocab,
            block_max, block_arg, BLOCK=BLOCK, GREEDY=True,
        )  # fmt: skip
    return block_arg.gather(1, block_max.argmax(dim=1, keepdim=True)).squeeze(1)


def greedy_with_sampling_options_reference(logits, state_rows, counts, row_floats, row_ints, bias_tokens, bias_values, stop_ids):  # fmt: skip
    return apply_sampling_options_reference(
        logits, state_rows, counts, row_floats, row_ints, bias_tokens, bias_values, stop_ids
    ).argmax(dim=-1)


def apply_sampling_options_reference(logits, state_rows, counts, row_floats, row_ints, bias_tokens, bias_values, stop_ids):  # fmt: skip
    """The same math as `_sampling_options_kernel` in torch (CPU engine, tests)."""
    x = logits.float().clone()
    rows = state_rows.long()
    ints = row_ints[rows].long()
    index = torch.arange(x.shape[0], device=x.device)
    width = torch.arange(bias_tokens.shape[1], device=x.device)
    valid = width < ints[:, 2:3]
    r = index.unsqueeze(1).expand_as(valid)[valid]
    x.index_put_((r, bias_tokens[rows].long()[valid]), bias_values[rows][valid], accumulate=True)
    width = torch.arange(stop_ids.shape[1], device=x.device)
    masked = (width < ints[:, 3:4]) & (ints[:, 1:2] < ints[:, 0:1])
    r = index.unsqueeze(1).expand_as(masked)[masked]
    x[r, stop_ids[rows].long()[masked]] = float("-inf")
    state = counts[rows]
    output = (state & COUNT_MASK).float()
    seen = (state >= PROMPT_FLAG) | (output > 0)
    floats = row_floats[rows]
    repetition = floats[:, 2:3]
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - floats[:, 1:2] * output
    return x - floats[:, 0:1] * (output > 0)


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


@triton.jit(do_not_specialize=["vocab_size", "logits_stride", "num_blocks"])
def _count_greater_kernel(
    logits_ptr,
    logits_stride,
    row_ids_ptr,
    threshold_ptr,
    partial_ptr,
    vocab_size,
    num_blocks,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    row = tl.load(row_ids_ptr + i).to(tl.int64)
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=mask, other=float("-inf"))
    threshold = tl.load(threshold_ptr + i)
    count = tl.sum((x.to(tl.float32) > threshold).to(tl.int32), 0)
    tl.store(partial_ptr + i * num_blocks + block, count)


def logprob_candidates(logits: torch.Tensor, row_ids: torch.Tensor, k: int, method: str | None = None):  # fmt: skip
    """Raw logits [S, V], rows [R] of them (int) -> (log-sum-exp [R] f32, top values [R, k]
    f32 of the raw logits, top ids [R, k] int64), best first. One pass over the rows.

    `method` (default: CANDIDATES, from ATOM_LOGPROB_CANDIDATES): "rounds" (this module's
    kernel: k rounds of max per block), "filtered" (atom/kernels/logprob_topk.py: a
    threshold from sub-block maxima, ties to the lower index, merged by a second kernel;
    k above its capacity: the rounds), "filtered_torch_merge" (the same candidates merged
    by torch.topk) or "torch" (logsumexp + torch.topk of the fp32 rows)."""
    method = method or CANDIDATES
    if method not in CANDIDATE_METHODS:
        raise CandidateMethodError(
            f"logprob candidates method {method!r} (ATOM_LOGPROB_CANDIDATES): "
            f"use one of {', '.join(CANDIDATE_METHODS)}"
        )
    if not use_triton(logits):
        return logprob_candidates_reference(logits, row_ids, k)
    if method == "torch":
        return logprob_candidates_reference(logits, row_ids, k)
    if method.startswith("filtered") and k <= logprob_topk.CAPACITY:
        merge = "torch" if method == "filtered_torch_merge" else "triton"
        return logprob_topk.logprob_candidates_filtered(logits, row_ids, k, merge=merge)
    return merge_block_candidates(*block_candidates(logits, row_ids, k), k)


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


def logprob_candidates_reference(logits: torch.Tensor, row_ids: torch.Tensor, k: int):
    raw = logits[row_ids.long()].float()
    lse = raw.logsumexp(dim=1)
    values, ids = raw.topk(k, dim=1)
    return lse, values, ids


def count_greater(logits: torch.Tensor, row_ids: torch.Tensor, threshold: torch.Tensor):
    """[R] int64: how many raw logits of row row_ids[i] exceed threshold[i] (f32)."""
    if not use_triton(logits):
        return count_greater_reference(logits, row_ids, threshold)
    vocab = logits.shape[1]
    rows = row_ids.shape[0]
    num_blocks = triton.cdiv(vocab, BLOCK)
    partial = torch.empty(rows, num_blocks, dtype=torch.int32, device=logits.device)
    if rows:
        _count_greater_kernel[(rows, num_blocks)](
            logits, logits.stride(0), row_ids, threshold, partial, vocab, num_blocks, BLOCK=BLOCK
        )
    return partial.sum(dim=1)


def count_greater_reference(logits, row_ids, threshold):
    return (logits[row_ids.long()].float() > threshold.unsqueeze(1)).sum(dim=1)

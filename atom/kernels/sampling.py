"""Sampling options and log-probabilities in few passes over the logits [S, V].

The sampling pass (`_sampling_pass_kernel`, one program per row and BLOCK logits) reads a
row's logits once and, by its constexpr switches:

- OPTIONS: applies logit_bias, min_tokens masking and vLLM's repetition / frequency /
  presence penalties, reading the row's state from device tensors owned by `SamplingState`
  (atom/model_engine/sampling/state.py):

      counts      [R, V] int32   output-token counts of state row r; the sign bit
                                 (PROMPT_FLAG) set where the token occurs in the prompt
      row_floats  [R, 3] f32     presence, frequency, repetition
      row_ints    [R, 4] int32   min_tokens, output tokens so far, bias entries, stop ids
      bias_start  [R, blocks + 1] int32  where each block's bias entries start (sorted)
      bias_tokens [R, Wb] int32 (sorted per row), bias_values [R, Wb] f32,
      stop_ids    [R, Ws] int32

      x = logits + bias (then -inf at the stop ids while output tokens < min_tokens)
      x = where(seen, x > 0 ? x / repetition : x * repetition, x)   seen: prompt or output
      x -= frequency * count ; x -= presence * (count > 0)

  A block visits only its own bias entries (looping over a row's 16 entries in every
  block tripled the pass's time).
- MODE: writes the processed logits (`apply_sampling_options`), or keeps each block's max
  and first index (`greedy_with_sampling_options`: all-greedy steps without a grammar).
- STATS: the RAW logits' log-softmax statistics and sub-block maxima (`LogitStats`), from
  which atom/kernels/logprob_topk.py takes the top-k log-probabilities without another
  pass over the vocabulary (`logprob_candidates`, method "select").

`count_greater`: the sampled token's rank (how many logits exceed its own), one pass;
`count_sampled`: each row's sampled token counted into its state row. Nothing sorts the
vocabulary.

Runtime lengths (do_not_specialize): vocab_size, the table widths, k, num_blocks, strides.
Geometry (constexpr): BLOCK, SUB, the switches. Row counts come from the grid. Offsets are
int64.
"""

from __future__ import annotations

import torch

from atom.kernels import logprob_topk
from atom.kernels.platform import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: keep the module importable for the references
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f), cdiv=None)
    tl = SimpleNamespace(constexpr=None)

PROMPT_FLAG = -(1 << 31)  # in counts: the sign bit flags a token of the prompt
# logits per program of the sampling pass, its warps: the fastest of 1024-8192 and 2-8 warps
# (docs/benchmarks.md)
BLOCK = 1024
NUM_WARPS = 4


@triton.jit(
    do_not_specialize=[
        "logits_stride", "bias_width", "stop_width", "vocab_size", "num_blocks", "sub_width"
    ]
)  # fmt: skip
def _sampling_pass_kernel(
    logits_ptr,
    logits_stride,
    row_ids_ptr,  # HAS_ROW_IDS: program i reads logits row row_ids[i] (else row i)
    out_ptr,  # MODE 2: the processed logits [rows, V] f32
    state_rows_ptr,
    counts_ptr,
    row_floats_ptr,
    row_ints_ptr,
    bias_start_ptr,
    bias_tokens_ptr,
    bias_values_ptr,
    bias_width,
    stop_ids_ptr,
    stop_width,
    vocab_size,
    num_blocks,
    block_best_ptr,  # MODE 1: each block's max of the processed logits and its first index
    block_arg_ptr,
    stat_max_ptr,  # STATS: the raw logits' block max, sum of exp, sub-block maxima
    stat_sum_ptr,
    sub_max_ptr,
    sub_width,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    OPTIONS: tl.constexpr,  # apply the options of the row's SamplingState row
    MODE: tl.constexpr,  # 0: nothing of the processed logits, 1: block argmax, 2: write
    STATS: tl.constexpr,
    HAS_ROW_IDS: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    row = tl.load(row_ids_ptr + i).to(tl.int64) if HAS_ROW_IDS else i
    # int32 positions in the block (half the registers of int64 ones); the block's int64
    # start is added where a vocabulary index is formed
    start = block.to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < vocab_size - start
    x = tl.load(logits_ptr + row * logits_stride + start + offs, mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    slot = i * num_blocks + block
    if STATS:
        best = tl.max(x, 0)
        # finite lanes only: a block of -inf logits has sum 0 (not exp(nan))
        tl.store(stat_max_ptr + slot, best)
        tl.store(stat_sum_ptr + slot, tl.sum(tl.where(x > float("-inf"), tl.exp(x - best), 0.0), 0))  # fmt: skip
        subs = block * (BLOCK // SUB) + tl.arange(0, BLOCK // SUB)
        sub_max = tl.max(tl.reshape(x, (BLOCK // SUB, SUB)), 1)
        tl.store(sub_max_ptr + i * sub_width + subs, sub_max, mask=subs < sub_width)
    if OPTIONS:
        state = tl.load(state_rows_ptr + i).to(tl.int64)
        presence = tl.load(row_floats_ptr + state * 3)
        frequency = tl.load(row_floats_ptr + state * 3 + 1)
        repetition = tl.load(row_floats_ptr + state * 3 + 2)
        min_tokens = tl.load(row_ints_ptr + state * 4)
        num_output = tl.load(row_ints_ptr + state * 4 + 1)
        num_stop = tl.load(row_ints_ptr + state * 4 + 3)
        # the row's bias entries sorted by token: only this block's, from its offsets
        first = tl.load(bias_start_ptr + state * (num_blocks + 1) + block)
        last = tl.load(bias_start_ptr + state * (num_blocks + 1) + block + 1)
        for j in range(first, last):
            token = tl.load(bias_tokens_ptr + state * bias_width + j)
            value = tl.load(bias_values_ptr + state * bias_width + j)
            x = tl.where(offs == token - start, x + value, x)
        if num_output < min_tokens:
            for j in range(num_stop):
                token = tl.load(stop_ids_ptr + state * stop_width + j)
                x = tl.where(offs == token - start, float("-inf"), x)
        counts = tl.load(counts_ptr + state * vocab_size + start + offs, mask=mask, other=0)
        output = (counts & 0x7FFFFFFF).to(tl.float32)
        seen = (counts < 0) | (output > 0)  # the sign bit: a token of the prompt
        penalised = tl.where(x > 0, x / repetition, x * repetition)
        x = tl.where(seen, penalised, x)
        x = x - frequency * output
        x = x - tl.where(output > 0, presence, 0.0)
    if MODE == 1:
        x = tl.where(mask, x, float("-inf"))
        best, index = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(block_best_ptr + slot, best)
        tl.store(block_arg_ptr + slot, tl.minimum(start + index, vocab_size - 1))
    if MODE == 2:
        tl.store(out_ptr + i * vocab_size + start + offs, x, mask=mask)


def _pass(logits, rows: int, mode: int, state=None, stats: bool = False, row_ids=None):
    """Launch the sampling pass over `rows` rows; returns (out, block_best, block_arg,
    LogitStats or None)."""
    vocab = logits.shape[1]
    device = logits.device
    num_blocks = triton.cdiv(vocab, BLOCK)
    sub_width = triton.cdiv(vocab, logprob_topk.SUB)
    f32 = dict(dtype=torch.float32, device=device)
    out = torch.empty(rows, vocab, **f32) if mode == 2 else None
    best = torch.empty(rows, num_blocks, **f32) if mode == 1 else None
    arg = torch.empty(rows, num_blocks, dtype=torch.int64, device=device) if mode == 1 else None
    found = None
    if stats:
        found = logprob_topk.LogitStats(
            torch.empty(rows, num_blocks, **f32),
            torch.empty(rows, num_blocks, **f32),
            torch.empty(rows, sub_width, **f32),
        )
    if rows:
        any_tensor = logits
        state_rows, counts, floats, ints, bias_start, bias_tokens, bias_values, stop_ids = (
            state or (any_tensor,) * 8
        )
        _sampling_pass_kernel[(rows, num_blocks)](
            logits, logits.stride(0), row_ids if row_ids is not None else any_tensor,
            out if out is not None else any_tensor,
            state_rows, counts, floats, ints, bias_start, bias_tokens, bias_values,
            bias_tokens.shape[-1], stop_ids, stop_ids.shape[-1], vocab, num_blocks,
            best if best is not None else any_tensor, arg if arg is not None else any_tensor,
            *((found.block_max, found.block_sum, found.sub_max) if stats else (any_tensor,) * 3),
            sub_width, BLOCK=BLOCK, SUB=logprob_topk.SUB, OPTIONS=state is not None,
            MODE=mode, STATS=stats, HAS_ROW_IDS=row_ids is not None, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out, best, arg, found


def apply_sampling_options(logits, state_rows, *tables):
    """logits [S, V] (any float dtype, unit stride in V), state_rows [S] int32, the
    SamplingState's tables -> new float32 [S, V] with the options applied (see the module
    docstring)."""
    if not use_triton(logits):
        return apply_sampling_options_reference(logits, state_rows, *tables)
    return _pass(logits, logits.shape[0], 2, (state_rows, *tables))[0]


def greedy_with_sampling_options(logits, state_rows, *tables, stats: bool = False):
    """argmax [S] int64 (first index of the maximum) of the logits with the options applied,
    without writing them: each block's (max, argmax), then a merge over [S, blocks]. With
    `stats`, (argmax, LogitStats of the raw rows) from the same pass."""
    if not use_triton(logits):
        tokens = greedy_with_sampling_options_reference(logits, state_rows, *tables)
        return (tokens, None) if stats else tokens
    _, best, arg, found = _pass(logits, logits.shape[0], 1, (state_rows, *tables), stats)
    tokens = arg.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1)
    return (tokens, found) if stats else tokens


def logit_stats(logits: torch.Tensor, row_ids: torch.Tensor) -> logprob_topk.LogitStats:
    """LogitStats of the raw logits rows row_ids [R] (the pass with STATS alone)."""
    return _pass(logits, row_ids.shape[0], 0, stats=True, row_ids=row_ids)[3]


def greedy_with_sampling_options_reference(logits, state_rows, *tables):
    return apply_sampling_options_reference(logits, state_rows, *tables).argmax(dim=-1)


def apply_sampling_options_reference(logits, state_rows, counts, row_floats, row_ints, bias_start, bias_tokens, bias_values, stop_ids):  # fmt: skip
    """The same math as `_sampling_pass_kernel`'s options in torch (CPU engine, tests);
    `bias_start` (the kernel's per-block offsets) is not needed here."""
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
    output = (state & ~PROMPT_FLAG).float()
    seen = (state < 0) | (output > 0)
    floats = row_floats[rows]
    repetition = floats[:, 2:3]
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - floats[:, 1:2] * output
    return x - floats[:, 0:1] * (output > 0)


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


def logprob_candidates(logits: torch.Tensor, row_ids: torch.Tensor, k: int, stats=None):  # fmt: skip
    """Raw logits [S, V], rows [R] of them (int) -> (log-sum-exp [R] f32, top values [R, k]
    f32 of the raw logits, top ids [R, k] int64), best first, ties to the lower index.

    The top k selected from the sampling pass's LogitStats (atom/kernels/logprob_topk.py):
    `stats` of all S rows when the options pass made them, else a stats pass over the R
    rows; k above logprob_topk.KMAX, or no Triton: the torch reference (logsumexp + topk of
    the fp32 rows). The alternatives that lost (k rounds of max per block) sit beside the
    benchmarks (benchmarks/candidates/logprob_rounds.py)."""
    if not use_triton(logits) or k > logprob_topk.KMAX or k == 0:
        return logprob_candidates_reference(logits, row_ids, k)
    if stats is None:
        stats = logit_stats(logits, row_ids)
        stat_rows = torch.arange(row_ids.shape[0], device=logits.device)
    else:
        stat_rows = row_ids
    return logprob_topk.select_topk(logits, row_ids, stats, stat_rows, k)


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


@triton.jit(do_not_specialize=["vocab_size"])
def _count_sampled_kernel(counts_ptr, row_ints_ptr, state_rows_ptr, tokens_ptr, vocab_size):
    """counts[state_rows[i], tokens[i]] += 1 and the row's output tokens += 1, except for the
    null row 0 (neutral options: its counts are never read). Grid (S,); a state row appears
    at most once in a step (one per running request), so no atomics."""
    i = tl.program_id(0)
    state = tl.load(state_rows_ptr + i).to(tl.int64)
    token = tl.load(tokens_ptr + i).to(tl.int64)
    if state != 0:
        count = counts_ptr + state * vocab_size + token
        tl.store(count, tl.load(count) + 1)
        tl.store(row_ints_ptr + state * 4 + 1, tl.load(row_ints_ptr + state * 4 + 1) + 1)


def count_sampled(counts, row_ints, state_rows, tokens) -> None:
    """Count each sampling row's token into its state row (device tensors [S])."""
    if not use_triton(counts):
        real = state_rows != 0
        rows, tokens = state_rows[real].long(), tokens[real].long()
        ones = torch.ones(len(rows), dtype=counts.dtype, device=counts.device)
        counts.index_put_((rows, tokens), ones, accumulate=True)
        row_ints[:, 1].index_put_((rows,), ones.int(), accumulate=True)
        return
    if len(tokens):
        _count_sampled_kernel[(len(tokens),)](counts, row_ints, state_rows, tokens, counts.shape[1])  # fmt: skip

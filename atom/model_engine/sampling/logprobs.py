"""Log-probabilities of sampled and prompt tokens, from the model's raw distribution.

Computed on the device from the logits as the LM head returns them (float32), before
temperature, penalties, logit_bias, top-k/top-p and grammar masks, as vLLM's default
`raw_logprobs` mode does: for each requested row the chosen token's log-probability, its
rank (1 = most likely) and the top k alternatives. One log_softmax and one topk per step
for all rows that asked; the results reach the host with the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class Logprob:
    """One token's log-probability with its rank and the most likely alternatives.

    `top` is a list of (token id, logprob), most likely first. An engine step builds its
    Logprobs from the step's host arrays without making the (token id, logprob) pairs:
    each entry keeps its row of the step's [R, K] arrays and makes its `top` list the
    first time it is read (a step of 256 rows asking for 20 alternatives would otherwise
    build 5,120 Python tuples whether anybody reads them or not).
    """

    __slots__ = ("token_id", "logprob", "rank", "_top", "_rows", "_row", "_k")

    def __init__(
        self,
        token_id: int,
        logprob: float,
        rank: int,  # 1 = the most likely token
        top: list[tuple[int, float]] | None = None,
    ):
        self.token_id = token_id
        self.logprob = logprob
        self.rank = rank
        self._top = [] if top is None else top
        self._rows: TopRows | None = None

    @classmethod
    def of_row(cls, token_id: int, logprob: float, rank: int, rows: TopRows, row: int, k: int):
        """An entry whose alternatives are the first k of row `row` of `rows` (made on
        first read)."""
        entry = cls.__new__(cls)
        entry.token_id, entry.logprob, entry.rank = token_id, logprob, rank
        entry._top, entry._rows, entry._row, entry._k = None, rows, row, k
        return entry

    @property
    def top(self) -> list[tuple[int, float]]:
        if self._rows is not None:
            self._top = self._rows.pairs(self._row, self._k)
            self._rows = None  # the step's arrays are no longer held for this entry
        return self._top

    @top.setter
    def top(self, value: list[tuple[int, float]]) -> None:
        self._top, self._rows = value, None

    def __eq__(self, other) -> bool:
        if not isinstance(other, Logprob):
            return NotImplemented
        return (self.token_id, self.logprob, self.rank, self.top) == (
            other.token_id,
            other.logprob,
            other.rank,
            other.top,
        )

    __hash__ = None  # mutable, as the dataclass it replaces

    def __repr__(self) -> str:
        return (
            f"Logprob(token_id={self.token_id!r}, logprob={self.logprob!r}, "
            f"rank={self.rank!r}, top={self.top!r})"
        )

    def __reduce__(self):  # pickles as a plain entry
        return Logprob, (self.token_id, self.logprob, self.rank, self.top)


class TopRows:
    """One step's top alternatives on the host: ids [R, K] int64, logprobs [R, K] f32
    (numpy, copied out of the transfer's pinned memory)."""

    __slots__ = ("ids", "values")

    def __init__(self, ids, values):
        self.ids = ids
        self.values = values

    def pairs(self, row: int, k: int) -> list[tuple[int, float]]:
        return list(zip(self.ids[row, :k].tolist(), self.values[row, :k].tolist(), strict=True))


@dataclass
class LogprobTensors:
    """Per requested row: chosen logprob [R], rank [R], top ids / values [R, K]."""

    chosen: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_values: torch.Tensor

    def to_host(self, non_blocking: bool = True) -> LogprobTensors:
        return LogprobTensors(*(t.to("cpu", non_blocking=non_blocking) for t in self._fields()))

    def _fields(self):
        return self.chosen, self.ranks, self.top_ids, self.top_values

    def entries(self, token_ids: list[int], ks: list[int]) -> list[Logprob]:
        """Host tensors -> one Logprob per row, each with its own number of alternatives:
        two short lists per step; the alternatives stay in arrays until read."""
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        rows = TopRows(_host_array(self.top_ids), _host_array(self.top_values))
        of_row = Logprob.of_row
        return [
            of_row(token, chosen[i], ranks[i], rows, i, k)
            for i, (token, k) in enumerate(zip(token_ids, ks, strict=True))
        ]


def _host_array(tensor: torch.Tensor):
    """A numpy copy of a host tensor (its memory may be pinned, and reused once freed)."""
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; the values are exact in f32
        return tensor.float().numpy()
    return tensor.numpy().copy()


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobTensors:
    """logits [R, V] (any float dtype), token_ids [R] -> LogprobTensors with K = k."""
    return gather_logprobs(logits.float().log_softmax(dim=-1), token_ids, k)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobTensors:
    """log-softmaxed logits [R, V], token_ids [R] -> LogprobTensors with K = k."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)
    else:
        top_values = logprobs.new_empty((logprobs.shape[0], 0))
        top_ids = token_ids.new_empty((logprobs.shape[0], 0))
    return LogprobTensors(chosen, ranks, top_ids, top_values)


@dataclass
class StepLogprobs:
    """One step's log-probabilities on their way to the host.

    `sample_rows[i]` (a row of the step's sampled tokens) asked for `sample_k[i]`
    alternatives; `prompt_spans` are (sequence, first target position, count, k): the
    log-probabilities of token_ids[first : first + count] given the tokens before them,
    rows of `prompt` in that order.
    """

    sample_rows: list[int]
    sample_k: list[int]
    sample: LogprobTensors | None
    prompt_spans: list[tuple[object, int, int, int]]
    prompt_token_ids: list[int]
    prompt: LogprobTensors | None

    def to_host(self, non_blocking: bool = True) -> StepLogprobs:
        return StepLogprobs(
            self.sample_rows,
            self.sample_k,
            None if self.sample is None else self.sample.to_host(non_blocking),
            self.prompt_spans,
            self.prompt_token_ids,
            None if self.prompt is None else self.prompt.to_host(non_blocking),
        )

    def sampled(self, tokens: list[int]) -> dict[int, Logprob]:
        """Row of the sampled tokens -> its Logprob (host tensors)."""
        if self.sample is None:
            return {}
        chosen = [tokens[row] for row in self.sample_rows]
        return dict(zip(self.sample_rows, self.sample.entries(chosen, self.sample_k), strict=True))

    def prompt_entries(self):
        """(sequence, first position, [Logprob] of the span) per span (host tensors)."""
        if self.prompt is None:
            return []
        ks = [k for _, _, count, k in self.prompt_spans for _ in range(count)]
        entries = self.prompt.entries(self.prompt_token_ids, ks)
        result, start = [], 0
        for seq, first, count, _ in self.prompt_spans:
            result.append((seq, first, entries[start : start + count]))
            start += count
        return result


def merge_step_logprobs(parts: list[tuple[StepLogprobs | None, int]]) -> StepLogprobs | None:
    """Join micro-batches' StepLogprobs; each comes with its first sampled-token row."""
    present = [(p, offset) for p, offset in parts if p is not None]
    if not present:
        return None
    if len(present) == 1 and present[0][1] == 0:
        return present[0][0]

    def cat(items):
        items = [t for t in items if t is not None]
        if not items:
            return None
        width = max(t.top_ids.shape[1] for t in items)
        padded = [_pad_top(t, width) for t in items]
        return LogprobTensors(*(torch.cat(group) for group in zip(*(t._fields() for t in padded), strict=True)))  # fmt: skip

    return StepLogprobs(
        [row + offset for p, offset in present for row in p.sample_rows],
        [k for p, _ in present for k in p.sample_k],
        cat([p.sample for p, _ in present]),
        [span for p, _ in present for span in p.prompt_spans],
        [t for p, _ in present for t in p.prompt_token_ids],
        cat([p.prompt for p, _ in present]),
    )


def _pad_top(t: LogprobTensors, width: int) -> LogprobTensors:
    extra = width - t.top_ids.shape[1]
    if extra == 0:
        return t
    rows = t.top_ids.shape[0]
    return LogprobTensors(
        t.chosen,
        t.ranks,
        torch.cat([t.top_ids, t.top_ids.new_zeros((rows, extra))], dim=1),
        torch.cat([t.top_values, t.top_values.new_full((rows, extra), float("-inf"))], dim=1),
    )

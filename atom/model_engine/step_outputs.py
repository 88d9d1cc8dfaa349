"""What a step hands out: one StepOutput per request that received tokens (built once,
by the engine, from the scheduler's completion of the step); a finished request's
RequestOutput; and the engine's cumulative counters."""

from __future__ import annotations

from dataclasses import dataclass

from atom.model_engine.sampling.logprobs import Logprob
from atom.model_engine.sequence import Sequence


@dataclass
class StepOutput:
    """What one step produced for one request."""

    seq_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[Logprob] | None = None  # of new_token_ids, when the request asked
    # On a request's first output, when it asked: one per prompt token (the first None).
    prompt_logprobs: list[Logprob | None] | None = None
    num_cached_tokens: int = 0  # prefix-cache hits, set on the first output
    queue_seconds: float | None = None  # arrival to first step, set on the first output
    error: str | None = None  # finish_reason "error": why (for the client; no traceback)


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int = 0
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None
    # All n samples of the prompt (n > 1), index order; the fields above are sample 0's.
    outputs: list[RequestOutput] | None = None


def step_output(seq: Sequence, new: list[int], logprob: Logprob | None) -> StepOutput:
    """The StepOutput of `seq`, which received `new` this step (and `logprob`, of its one
    token, when it asked); counts them as handed out. A request's first output carries
    its prefix-cache hits, queue time and prompt log-probabilities."""
    finished = seq.is_finished
    reason = seq.finish_reason.value if finished else None
    output = StepOutput(seq.seq_id, new, finished, reason)
    if seq.logprobs is not None:
        seq.logprobs.append(logprob)
        output.logprobs = [logprob]
    seq.num_emitted_tokens += len(new)
    if seq.num_emitted_tokens == len(new):  # the request's first output
        output.num_cached_tokens = seq.num_cached_tokens
        if seq.first_scheduled_time is not None:
            output.queue_seconds = seq.first_scheduled_time - seq.arrival_time
        output.prompt_logprobs = prompt_logprobs_of(seq)
    return output


def prompt_logprobs_of(seq: Sequence) -> list[Logprob | None] | None:
    if seq.prompt_logprobs is None:
        return None
    return [None] + [seq.prompt_logprobs.get(p) for p in range(1, seq.num_prompt_tokens)]


def request_output(seq: Sequence, text: str) -> RequestOutput:
    """A request's whole output (`text`: its output tokens, decoded)."""
    return RequestOutput(
        prompt=seq.prompt,
        prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
        text=text,
        token_ids=seq.output_token_ids,
        finish_reason=seq.finish_reason.value if seq.finish_reason else None,
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=seq.logprobs,
        prompt_logprobs=prompt_logprobs_of(seq),
    )


class EngineStats:
    """Cumulative counters (the server's /metrics reads these)."""

    def __init__(self):
        self.requests = 0
        self.steps = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.step_seconds = 0.0

    def record(self, batch, seconds: float) -> None:
        """Called after launch: each sequence's computed count includes this step."""
        self.steps += 1
        self.step_seconds += seconds
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            before = seq.num_computed_tokens - n
            self.prompt_tokens += max(0, min(seq.num_prompt_tokens, before + n) - before)

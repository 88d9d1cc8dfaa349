"""A request as the scheduler sees it: token ids, progress, and its KV blocks."""

from __future__ import annotations

import enum
import itertools
import time

from atom.sampling_params import SamplingParams

# Stands for a sampled token that is still on the device (asynchronous scheduling).
PLACEHOLDER_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # end-of-sequence or a stop token
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the client went away or the engine aborted it
    ERROR = "error"  # the step that computes its next token failed


class Sequence:
    """Prompt plus generated tokens of one request.

    `num_computed_tokens` counts tokens whose KV is in the cache; the scheduler moves it
    forward step by step (chunked prefill) and back to 0 on preemption (recompute).
    """

    _ids = itertools.count()

    def __init__(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
    ):
        self.seq_id = next(Sequence._ids)
        self.prompt = prompt  # the request's text, when it came as text (RequestOutput)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hits of the latest (re)admission
        self.block_table: list[int] = []
        self.block_version = 0  # bumped when the blocks are freed (page-table rows go stale)
        # Bumped when BlockManager.trim returns tail blocks: a page table that did not see
        # that step (the draft model's) cannot tell a regrown tail from the old one.
        self.block_trims = 0
        self.block_hashes: list[int] = []  # chained hashes of full computed blocks
        self.state_slot: int | None = None  # per-sequence state (V4), owned like the blocks
        self.num_preemptions = 0
        # (position in token_ids, row in the launching step's sampled tokens) while the
        # last token is a placeholder; see Scheduler.on_launch.
        self.pending_token: tuple[int, int] | None = None
        self.finishing = False  # its last token is in flight and reaches a length limit
        # Options beyond plain sampling (atom/model_engine/sampling/plan.py): log-probabilities
        # of the output tokens and, by target position, of the prompt; a grammar matcher.
        self.logprobs: list | None = [] if sampling_params.logprobs is not None else None
        self.prompt_logprobs: dict | None = (
            {} if sampling_params.prompt_logprobs is not None else None
        )
        self.grammar = None  # xgrammar GrammarMatcher of a structured-output request
        # A seeded request's torch.Generator, made on its first sampled step (runner_slot.py)
        # and kept across preemption, so seeded sampling does not restart.
        self.generator = None
        self.num_emitted_tokens = 0  # tokens the engine has handed out in StepOutputs
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None  # first step that computed it

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.value}, len={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

"""Continuous batching with chunked prefill, decode first, preemption by recompute.

Each step has a token budget (`max_num_batched_tokens`). Running sequences that decode
(one uncomputed token) are served first, then running sequences part-way through their
prefill, then waiting sequences in arrival order. A prefill larger than the remaining
budget is cut into chunks. When a running sequence needs a KV block and none is free,
the most recently admitted running sequence is preempted: its blocks are freed and it
returns to the front of the queue to be recomputed later (prefix caching often makes the
recompute cheap).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from atom.model_engine.block_manager import BlockManager
from atom.model_engine.sequence import PLACEHOLDER_TOKEN, FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: `seqs[i]` computes `num_new_tokens[i]` tokens (decodes first).

    Built once, by its owner, and never changed after: the scheduler builds the engine's
    batches (Scheduler.schedule), the speculator a verify step's copy with its drafts
    (`dataclasses.replace`, speculative/decoder.py), `split_batch` the micro-batches, the
    draft proposer and the tensor-parallel mirror their own. What happens to the batch
    later (launch, completion) is returned by those calls, not written here.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_decodes: int  # the first num_decodes entries are single-token decodes
    # (sequence, placeholder position) of each sampling row, in row order: where
    # Scheduler.on_launch puts the placeholder of the token it will receive. None: a batch
    # the scheduler did not build (micro-batches, draft steps, a rank's mirror).
    sampled: list[tuple[Sequence, int]] | None = None
    # For the page table: batches with equal `layout` hold the same sequences in the same
    # order; `grown` received KV blocks while this batch was scheduled; `step` numbers
    # batches (a slot that skipped one cannot trust `grown`). None: unknown.
    layout: int | None = None
    grown: list[Sequence] | None = None
    step: int | None = None
    # Speculative decoding (atom/model_engine/speculative): draft slots reserved per
    # sequence (num_new_tokens includes them; the scheduler's), and the proposals filling
    # them (the speculator's copy of the batch; None = nothing to verify).
    num_draft_tokens: list[int] | None = None
    draft_token_ids: list[list[int]] | None = None
    # Drafts left on the device by the proposer (a torch int64 tensor [num_seqs * d], batch
    # order; every sequence decodes with d drafts): `draft_token_ids` then holds
    # placeholders, which the runner fills on the device, and the verify step's result
    # brings the drafts to the host.
    device_drafts: object | None = None
    # False when no request of the batch asks for logprobs, penalties, grammars... (the
    # engine knows without a scan and tells the scheduler); None: unknown, the runner
    # looks (sampling_step.py).
    needs_sampling_plan: bool | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, index: int) -> bool:
        """Whether seqs[index] reaches its last token this step (and so samples one)."""
        seq = self.seqs[index]
        drafts = self.num_draft_tokens[index] if self.num_draft_tokens else 0
        return seq.num_computed_tokens + self.num_new_tokens[index] - drafts == len(seq)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int],
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the tail is preempted first
        self.num_preemptions = 0
        self._steps = 0
        self._layout = 0
        self._last_seqs: list[Sequence] = []
        # Speculative decoding: draft tokens a decode may add to its step (0 = none).
        self.lookahead: Callable[[Sequence], int] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ------------------------------------------------------------------------
    def schedule(
        self, only: set[Sequence] | None = None, needs_sampling_plan: bool | None = None
    ) -> ScheduledBatch | None:
        """The next step's batch. `only`: schedule none but these running sequences and
        admit nothing (the engine isolating a failed step's requests, failures.py).
        `needs_sampling_plan`: whether a live request asks for a sampling plan (the
        engine counts them), recorded in the batch."""
        budget = self.max_num_batched_tokens
        chosen: dict[Sequence, int] = {}  # insertion order = batch order
        bm = self.block_manager
        preemptions_before = self.num_preemptions

        grown: list[Sequence] = []
        decodes, prefills = [], []
        for seq in self.running:
            if not seq.finishing:
                (decodes if seq.num_uncomputed_tokens == 1 else prefills).append(seq)
        for seq in decodes + prefills:
            if budget == 0:
                break
            if only is not None and seq not in only:
                continue
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            uncomputed = seq.num_uncomputed_tokens
            num_new = min(uncomputed, budget)
            # drafts after the sequence's last token: a decode, or (speculation rolled back
            # by state snapshot) the recompute of a few kept tokens; the proposer says
            if self.lookahead is not None and uncomputed <= budget:
                num_new = min(uncomputed + self.lookahead(seq), budget)
            while not bm.can_grow(seq, num_new):
                victim = self.running[-1]
                budget += chosen.pop(victim, 0)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            if bm.grow(seq, num_new):
                grown.append(seq)
            elif self.lookahead is not None and bm.trim(seq, num_new):
                grown.append(seq)  # returned the blocks of drafts it no longer needs
            chosen[seq] = num_new
            budget -= num_new

        # After a preemption memory is tight: admit nothing new this step (nor while
        # the engine isolates a failed step's requests).
        preempted = self.num_preemptions != preemptions_before or only is not None
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            prefix = bm.find_prefix(seq)
            num_new = min(len(seq) - len(prefix) * bm.block_size, budget)
            if not bm.can_admit(seq, prefix, num_new):
                break
            self.waiting.popleft()
            bm.admit(seq, prefix)
            bm.grow(seq, num_new)
            grown.append(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen[seq] = num_new
            budget -= num_new

        if not chosen:
            return None
        seqs = list(chosen)
        num_decodes = 0
        for seq in seqs:
            if chosen[seq] == 1 and seq.num_uncomputed_tokens == 1:
                num_decodes += 1
            else:
                break
        if seqs != self._last_seqs:  # identity comparison, in C
            self._layout += 1
            self._last_seqs = seqs
        self._steps += 1
        num_new_tokens = [chosen[s] for s in seqs]
        num_draft_tokens = None
        if self.lookahead is not None:
            num_draft_tokens = [max(0, chosen[s] - s.num_uncomputed_tokens) for s in seqs]
        return ScheduledBatch(
            seqs,
            num_new_tokens,
            num_decodes,
            sampled=_sampling_rows(seqs, num_new_tokens, num_draft_tokens),
            layout=self._layout,
            grown=grown,
            step=self._steps,
            num_draft_tokens=num_draft_tokens,
            needs_sampling_plan=needs_sampling_plan,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0  # recompute from scratch (prefix cache permitting)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- after the launch and after the forward ---------------------------------------------
    def on_launch(self, batch: ScheduledBatch) -> None:
        """The batch's forward is queued: count its tokens as computed and give each
        sampling sequence a placeholder for the token it will receive.

        With asynchronous scheduling the next step is scheduled before this one's tokens
        are known: a decode's input is then the placeholder, which the ModelRunner fills
        on the device from this step's sampled tokens. A sequence whose length limit this
        token reaches is not scheduled again.
        """
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new
        for row, (seq, position) in enumerate(batch.sampled):
            seq.pending_token = (position, row)
            seq.token_ids.append(PLACEHOLDER_TOKEN)
            limit = seq.sampling_params.max_tokens
            if seq.num_output_tokens >= limit or len(seq) >= self.max_model_len:
                seq.finishing = True

    def on_complete(
        self, batch: ScheduledBatch, sampled: list[int] | list[list[int]]
    ) -> list[tuple[Sequence, list[int]]]:
        """Fill the placeholders with the sampled tokens (in sampling order) and retire
        finished sequences. Returns each sequence that received tokens, with them (a
        speculative step's: the accepted drafts and one more, cut at a stop)."""
        updated = []
        for (seq, position), token in zip(batch.sampled, sampled, strict=True):
            if seq.status == SequenceStatus.FINISHED:  # aborted, or stopped a step earlier
                continue
            # Speculative steps give a list: the accepted drafts, then one more token.
            tokens = token if isinstance(token, list) else (token,)
            seq.token_ids[position] = tokens[0]
            if seq.pending_token is not None and seq.pending_token[0] == position:
                seq.pending_token = None
            end = position + 1
            reason = self._finish_reason(seq, tokens[0], end)
            for extra in tokens[1:]:  # synchronous steps only: no placeholder follows
                if reason is not None:
                    break
                seq.token_ids.append(extra)
                end += 1
                reason = self._finish_reason(seq, extra, end)
            updated.append((seq, seq.token_ids[position:end]))
            if reason is not None:
                del seq.token_ids[end:]  # a placeholder of a step still in flight
                self.finish(seq, reason)
        for seq in batch.seqs:
            if seq.status != SequenceStatus.FINISHED:
                self.block_manager.register_computed(seq)
        return updated

    def _finish_reason(self, seq: Sequence, token: int, length: int) -> FinishReason | None:
        params = seq.sampling_params
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if length - seq.num_prompt_tokens >= params.max_tokens or length >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire a sequence (also used for aborts); its blocks return to the pool."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def _sampling_rows(
    seqs: list[Sequence], num_new_tokens: list[int], num_draft_tokens: list[int] | None
) -> list[tuple[Sequence, int]]:
    """(sequence, placeholder position) of each sequence that reaches its last token in a
    step of `num_new_tokens` (drafts after it excluded), and so samples one."""
    rows = []
    for index, seq in enumerate(seqs):
        drafts = num_draft_tokens[index] if num_draft_tokens else 0
        length = len(seq.token_ids)
        if seq.num_computed_tokens + num_new_tokens[index] - drafts == length:
            rows.append((seq, length))
    return rows


def split_batch(batch: ScheduledBatch, parts: int) -> list[ScheduledBatch]:
    """`batch` cut into `parts` consecutive micro-batches (one per runner slot).

    Each part keeps the page-table facts of the whole batch: its layout key is the
    batch's plus the cut, and `grown` is shared (a slot ignores sequences it does not hold).
    """
    if parts == 1 or len(batch.seqs) < parts:
        return [batch]
    n = len(batch.seqs)
    cuts = [n * k // parts for k in range(parts + 1)]
    result = []
    for k in range(parts):
        a, b = cuts[k], cuts[k + 1]
        result.append(
            ScheduledBatch(
                batch.seqs[a:b],
                batch.num_new_tokens[a:b],
                min(max(batch.num_decodes - a, 0), b - a),
                layout=None if batch.layout is None else (batch.layout, k, a, b),
                grown=batch.grown,
                step=batch.step,
                needs_sampling_plan=batch.needs_sampling_plan,
            )
        )
    return result

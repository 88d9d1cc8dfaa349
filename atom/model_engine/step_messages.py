"""What reaches the tensor-parallel ranks each step: only what changed.

The scheduler lives with the engine; the ranks keep a mirror of the running sequences
(`SequenceMirror`) and receive one compact `StepMessage` per launched step, pickled once
for all ranks: sequences admitted since the last step (with their tokens and block ids),
sequences that left (finished, aborted or preempted), block ids appended to the others,
token values sampled since the last step, and the step itself (sequence ids and token
counts in batch order). Block tables are never resent whole.

The mirror replays the scheduler's launch bookkeeping (computed tokens advance, a
sequence that samples gets a placeholder for its token) so that every rank hands its
ModelRunner a batch equal to the engine's, field for field; `lengths` in the message
check this each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from atom.sampling_params import SamplingParams


class MirrorError(RuntimeError):
    """A rank's mirror of the sequences disagrees with the engine (a bug, not bad input)."""


@dataclass
class NewSequence:
    """A sequence as a rank first sees it (on admission or re-admission)."""

    seq_id: int
    token_ids: list[int]  # may end in a placeholder (its token is still in flight)
    num_computed_tokens: int  # prefix-cache hits
    block_table: list[int]
    block_version: int  # the page table keys rows by (seq id, version)
    sampling_params: SamplingParams
    pending_token: tuple[int, int] | None
    num_prompt_tokens: int = 0  # penalties tell prompt from output tokens


@dataclass
class StepMessage:
    added: list[NewSequence] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # ids gone for good
    preempted: list[int] = field(default_factory=list)  # ids that will be re-added later
    appended_blocks: list[tuple[int, list[int]]] = field(default_factory=list)
    # Sampled token values now known to the engine: (seq id, position, token) flattened.
    filled: list[int] = field(default_factory=list)
    # The step, in batch order. Plain int lists: they pickle smaller than numpy arrays
    # at these sizes (an array costs ~150 bytes of header).
    seq_ids: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # len(seq) at launch, checks the mirror
    num_decodes: int = 0
    # The scheduler's page-table facts (ScheduledBatch.layout / grown / step), so every
    # rank's page table takes the same O(1) / append / relayout path as the engine's would.
    layout: int | None = None
    grown: list[int] | None = None  # seq ids
    step: int | None = None


@dataclass
class _Known:
    """What the ranks know about one sequence."""

    seq: Sequence
    num_blocks: int
    num_preemptions: int


class StepEncoder:
    """Engine side: turns each ScheduledBatch into the StepMessage of what changed."""

    def __init__(self):
        self._known: dict[int, _Known] = {}
        self._filled: list[int] = []  # (seq id, position, token) flattened

    def record_sampled(self, batch: ScheduledBatch, tokens: list[int]) -> None:
        """The tokens of a completed step (in sampling order), for the next message."""
        for (seq, position), token in zip(batch.sampled or [], tokens, strict=True):
            self._filled += (seq.seq_id, position, token)

    def encode(self, batch: ScheduledBatch) -> StepMessage:
        message = StepMessage(
            num_decodes=batch.num_decodes,
            layout=batch.layout,
            grown=None if batch.grown is None else [s.seq_id for s in batch.grown],
            step=batch.step,
        )
        for seq_id, known in list(self._known.items()):
            seq = known.seq
            if seq.status == SequenceStatus.FINISHED:
                message.finished.append(seq_id)
            elif (
                seq.status == SequenceStatus.WAITING or seq.num_preemptions != known.num_preemptions
            ):
                message.preempted.append(seq_id)
            else:
                continue
            del self._known[seq_id]
        for seq in batch.seqs:
            known = self._known.get(seq.seq_id)
            if known is None:
                message.added.append(
                    NewSequence(
                        seq.seq_id,
                        list(seq.token_ids),
                        seq.num_computed_tokens,
                        list(seq.block_table),
                        seq.block_version,
                        seq.sampling_params,
                        seq.pending_token,
                        seq.num_prompt_tokens,
                    )
                )
                self._known[seq.seq_id] = _Known(seq, len(seq.block_table), seq.num_preemptions)
            elif len(seq.block_table) > known.num_blocks:
                message.appended_blocks.append((seq.seq_id, seq.block_table[known.num_blocks :]))
                known.num_blocks = len(seq.block_table)
        message.filled, self._filled = self._filled, []
        message.seq_ids = [s.seq_id for s in batch.seqs]
        message.num_new_tokens = list(batch.num_new_tokens)
        message.lengths = [len(s) for s in batch.seqs]
        return message


class MirroredSequence:
    """The fields of a Sequence that RunnerSlot.prepare and the sampler read."""

    __slots__ = (
        "seq_id",
        "token_ids",
        "num_computed_tokens",
        "block_table",
        "block_version",
        "sampling_params",
        "pending_token",
        "generator",
        "num_prompt_tokens",
    )

    def __init__(self, new: NewSequence):
        self.seq_id = new.seq_id
        self.token_ids = new.token_ids
        self.num_computed_tokens = new.num_computed_tokens
        self.block_table = new.block_table
        self.block_version = new.block_version
        self.sampling_params = new.sampling_params
        self.pending_token = new.pending_token
        self.generator = None  # a seeded request's generator, made by the sampler set-up
        self.num_prompt_tokens = new.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.token_ids)


class SequenceMirror:
    """Rank side: the running sequences, kept up to date from each StepMessage."""

    def __init__(self):
        self.seqs: dict[int, MirroredSequence] = {}
        # A preempted request keeps its random generator for its re-admission, as the
        # engine's Sequence does, so seeded sampling does not restart.
        self._parked_generators: dict[int, object] = {}

    def apply(self, message: StepMessage) -> ScheduledBatch:
        """Bring the mirror up to date and return the step's batch (mirror sequences)."""
        for seq_id in message.finished:
            self.seqs.pop(seq_id, None)
            self._parked_generators.pop(seq_id, None)
        for seq_id in message.preempted:
            seq = self.seqs.pop(seq_id, None)
            if seq is not None and seq.generator is not None:
                self._parked_generators[seq_id] = seq.generator
        for new in message.added:
            seq = self.seqs[new.seq_id] = MirroredSequence(new)
            seq.generator = self._parked_generators.pop(new.seq_id, None)
        for seq_id, blocks in message.appended_blocks:
            self.seqs[seq_id].block_table.extend(blocks)
        self._fill(message.filled)
        try:
            seqs = [self.seqs[i] for i in message.seq_ids]
        except KeyError as missing:
            raise MirrorError(f"step names sequence {missing} that this rank never saw") from None
        lengths = [len(s) for s in seqs]
        if lengths != message.lengths:
            raise MirrorError(
                f"sequence lengths differ from the engine's: {lengths} here, "
                f"{message.lengths} there (seq ids {message.seq_ids})"
            )
        grown = None
        if message.grown is not None:  # a grown sequence preempted in the same step is gone
            grown = [self.seqs[i] for i in message.grown if i in self.seqs]
        return ScheduledBatch(
            seqs,
            message.num_new_tokens,
            message.num_decodes,
            layout=message.layout,
            grown=grown,
            step=message.step,
        )

    def _fill(self, filled: list[int]) -> None:
        for index in range(0, len(filled), 3):
            seq_id, position, token = filled[index : index + 3]
            seq = self.seqs.get(seq_id)
            if seq is None or position >= len(seq.token_ids):
                continue  # it left, or stopped (the engine cut its tail)
            seq.token_ids[position] = token
            if seq.pending_token is not None and seq.pending_token[0] == position:
                seq.pending_token = None

    @staticmethod
    def on_launch(batch: ScheduledBatch) -> None:
        """Scheduler.on_launch for the mirror: tokens computed, placeholders for samples."""
        row = 0
        for index, seq in enumerate(batch.seqs):
            samples = batch.samples(index)
            seq.num_computed_tokens += batch.num_new_tokens[index]
            if samples:
                seq.pending_token = (len(seq.token_ids), row)
                seq.token_ids.append(PLACEHOLDER_TOKEN)
                row += 1

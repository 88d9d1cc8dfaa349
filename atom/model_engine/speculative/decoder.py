"""What the engine calls for speculative decoding (one object, built from the Config).

Per step (a step's proposals need the previous step's tokens, so a step with drafts
completes before the next is scheduled; with asynchronous scheduling a step whose
successor cannot draft, `needs_tokens` False, stays in flight as usual):

    scheduler.lookahead = decoder.lookahead  # before scheduling: drafts each decode may get
    batch = scheduler.schedule()             # 1 + drafts tokens per decode, blocks for them
    batch = decoder.propose(batch)           # a copy with draft_token_ids (or device_drafts)
    handle = runner.launch(batch)            # one forward verifies every row
    emitted = decoder.on_verified(batch, handle.result())  # KV rollback, counters
                                             # (device drafts come back with the result)
    scheduler.on_complete(batch, emitted)    # appends, stop/EOS checks inside the run

Rollback, as the model's family declares it (`SpeculationSupport.rollback`,
atom/attention/backend.py):
- positions (paged KV only): the verify step wrote KV for every draft; a sequence that
  kept `a` of its `d` drafts moves `num_computed_tokens` back by `d - a`, so the next step
  overwrites the rejected slots;
- state snapshot (per-sequence state rows: DeepSeek-V4 / V4.1, Qwen3-Next): `propose`
  saves the drafting sequences' state rows before the launch; a sequence that rejected
  any draft gets them back and moves `num_computed_tokens` back to where the step began,
  so its next step recomputes the kept tokens and the bonus token from the saved state
  (state_rollback.py), with new drafts after them while the step stays within k + 1
  tokens. One that kept every draft rolls nothing back.
Blocks reserved for rejected drafts stay with the sequence while its next step needs them
and return to the pool when it does not (`BlockManager.trim`, called by the scheduler);
the page table only ever sees blocks that a forward writes.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from atom.config import Config
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from atom.model_engine.speculative.proposers import DeviceDrafts, NgramProposer, Proposer
from atom.model_engine.speculative.state_rollback import StateSnapshots
from atom.model_engine.speculative.verify import accepted_tokens

logger = logging.getLogger(__name__)


class SpeculationStats:
    """Cumulative counters (the server's /metrics reads them)."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = 0  # sequence-steps that verified at least one draft
        self.proposed_tokens = 0
        self.accepted_tokens = 0
        self.emitted_tokens = 0  # tokens of drafting sequence-steps (accepted + 1 each)
        self.accepted_per_position = [0] * num_speculative_tokens  # draft j+1 kept
        self.state_restores = 0  # sequence-steps whose state rows were restored (snapshot)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.proposed_tokens += num_drafts
        self.accepted_tokens += num_accepted
        self.emitted_tokens += num_accepted + 1
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


class SpeculativeDecoder:
    def __init__(
        self,
        proposer: Proposer,
        num_speculative_tokens: int,
        max_model_len: int,
        state_snapshots: StateSnapshots | None = None,
    ):
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        # The target's state backups (families that roll back by state snapshot), or None.
        self.state_snapshots = state_snapshots
        self.stats = SpeculationStats(num_speculative_tokens)

    def lookahead(self, seq: Sequence) -> int:
        """Drafts `seq` may verify this step: at most k, never past max_tokens or
        max_model_len (the step emits drafts + 1 tokens at most). A decode drafts; so does,
        after a state-snapshot rollback, the step that recomputes the kept tokens, within
        k + 1 tokens in all (the verify steps' shape: their CUDA graphs; and a rejection
        there leaves at most k + 1 tokens to recompute)."""
        if seq.pending_token is not None:  # its last token is still on the device
            return 0
        uncomputed = len(seq) - seq.num_computed_tokens
        if uncomputed > 1 and (self.state_snapshots is None or not seq.num_output_tokens):
            return 0  # a prompt (or, rolled back by position, a recomputing sequence)
        limit = min(
            self.k + 1 - uncomputed,
            seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - len(seq) - 1,
        )
        return self.proposer.lookahead(seq, limit) if limit > 0 else 0

    def needs_tokens(self, batch: ScheduledBatch) -> bool:
        """Whether the step after `batch` (still in flight) may draft for one of its
        sequences once their tokens are known: then the engine completes `batch` before
        scheduling (asynchronous scheduling otherwise goes on, with no drafts for them)."""
        return any(
            self.proposer.may_propose(seq)
            for seq, _ in batch.sampled or ()
            if seq.pending_token is not None and not seq.finishing
        )

    def propose(self, batch: ScheduledBatch) -> ScheduledBatch:
        """The batch to launch: `batch` itself when no sequence drafts (a plain step), else
        its copy carrying the proposals (`draft_token_ids`, and `device_drafts` when the
        proposer leaves them on the device)."""
        counts = batch.num_draft_tokens
        if not counts or not any(counts):
            return batch
        on_device = getattr(self.proposer, "propose_on_device", None)
        if on_device is not None and _uniform_decodes(batch):
            drafts = on_device(batch.seqs, counts)
        else:
            drafts = self.proposer.propose(batch.seqs, counts)
        device_drafts = None
        if isinstance(drafts, DeviceDrafts):
            device_drafts = drafts.tokens
            drafts = [[PLACEHOLDER_TOKEN] * count for count in counts]
        for seq, draft, count in zip(batch.seqs, drafts, counts, strict=True):
            if len(draft) != count:
                raise RuntimeError(
                    f"the proposer gave {len(draft)} drafts for sequence {seq.seq_id}, "
                    f"{count} were scheduled"
                )
        if self.state_snapshots is not None:  # queued before the verify step's forward
            self.state_snapshots.save(
                [s.state_slot for s, d in zip(batch.seqs, drafts, strict=True) if d]
            )
        return replace(batch, draft_token_ids=drafts, device_drafts=device_drafts)

    def on_verified(self, batch: ScheduledBatch, result) -> list[list[int]]:
        """From the verify rows' (tokens, accepted) to each sampling sequence's new tokens;
        moves each drafting sequence's computed count back past its rejected drafts."""
        tokens, accepted, *checked = result
        index = {seq: i for i, seq in enumerate(batch.seqs)}
        drafts = [batch.draft_token_ids[index[seq]] for seq, _ in batch.sampled]
        if checked:  # the drafts came from the device: the rows carry them back
            row, on_host = 0, []
            for draft in drafts:
                on_host.append(checked[0][row : row + len(draft)])
                row += len(draft) + 1
            drafts = on_host
        emitted = accepted_tokens(drafts, tokens, accepted)
        restore = []  # state slots of sequences that rejected a draft (snapshot rollback)
        for (seq, position), draft, new in zip(batch.sampled, drafts, emitted, strict=True):
            if not draft or seq.status == SequenceStatus.FINISHED:
                continue
            num_accepted = len(new) - 1
            if self.state_snapshots is None:
                seq.num_computed_tokens -= len(draft) - num_accepted
            elif num_accepted < len(draft):  # back to the step's start, state as saved
                seq.num_computed_tokens -= batch.num_new_tokens[index[seq]]
                restore.append(seq.state_slot)
            self.stats.record(len(draft), num_accepted)
            self.proposer.on_verified(seq, position, len(draft), num_accepted)
        if restore:
            self.state_snapshots.restore(restore)
            self.stats.state_restores += len(restore)
        return emitted


def _uniform_decodes(batch: ScheduledBatch) -> bool:
    """Every sequence of the step decodes with the same number of drafts (the shape the
    runner fills from device drafts)."""
    counts = batch.num_draft_tokens
    first = counts[0]
    return first > 0 and all(
        count == first and new == first + 1 and len(seq) - seq.num_computed_tokens == 1
        for seq, new, count in zip(batch.seqs, batch.num_new_tokens, counts, strict=True)
    )


def make_decoder(
    config: Config, max_model_len: int, draft_runner=None, state_snapshots=None
) -> SpeculativeDecoder:
    k = config.num_speculative_tokens
    if config.speculative_method == "ngram":
        proposer = NgramProposer(config.ngram_min, config.ngram_max)
    else:
        from atom.model_engine.speculative.draft_model import DraftModelProposer

        proposer = DraftModelProposer(draft_runner, config.max_num_batched_tokens)
    logger.info("speculative decoding: %s, %d tokens per step", config.speculative_method, k)
    return SpeculativeDecoder(proposer, k, max_model_len, state_snapshots)

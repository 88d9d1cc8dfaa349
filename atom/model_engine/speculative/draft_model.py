"""The draft-model proposer: a smaller model with the target's vocabulary guesses ahead.

The draft runs on a runner of its own (DraftModelRunner, draft_runner.py) (its model, its runner slot with its own
buffers, publisher and page table, its decode CUDA graphs) and its own KV cache tensors
with the target's number of blocks, addressed by the target sequence's block ids: the
draft's KV of position p lives at the same slot as the target's, in the draft's tensors.
The target's scheduler reserves the blocks (1 + drafts positions per step), so the draft
never allocates anything.

Per step and drafting sequence with L tokens and d drafts:
1. catch up: compute the draft KV of the positions it has not seen ([computed, L), in
   chunks of the step budget) and take its greedy token at L - 1: draft 1;
2. d - 1 decode steps, each feeding the previous draft back on the device (the runner's
   placeholder fix-up, no host round trip) and taking the next greedy token.
The draft's KV is valid for real tokens only: after the verify step kept `a` drafts, it
holds positions < L + min(a, d - 1), so the next catch-up has 1 token (a decode step) or,
when every draft was kept, `CATCH_UP_TOKENS` = 2 (a short step the draft runner replays
from a CUDA graph, verify_graphs.py). A sequence freed and re-admitted (preemption;
`block_version` bumped) starts again from 0.

The d launches of a step go back to back on the draft runner's slot, each one's tokens
staying on the device for the next. When every sequence of the step drafts the same d
(`propose_on_device`: the common decode step), the drafts stay there for the target's
verify step too (DeviceDrafts) and the host does not wait at all; otherwise it waits once,
after the last launch (`host_syncs` counts the waits; a long catch-up cut into several
chunks adds one).

Proposals are greedy (one-hot q), which is what the rejection sampler assumes.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.sequence import PLACEHOLDER_TOKEN, Sequence
from atom.model_engine.speculative.draft_runner import DraftModelRunner
from atom.model_engine.speculative.proposers import DeviceDrafts
from atom.models.loader import open_model
from atom.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)
CATCH_UP_TOKENS = 2  # the most a catch-up step computes per sequence between verify steps


class _DraftView:
    """A target sequence as the draft runner sees it (what RunnerSlot.prepare reads)."""

    __slots__ = (
        "seq_id", "token_ids", "num_computed_tokens", "block_table", "block_version",
        "pending_token", "sampling_params",
    )  # fmt: skip

    def __init__(self, seq: Sequence, token_ids: list[int], num_computed: int, pending=None):
        self.seq_id = seq.seq_id
        self.token_ids = token_ids
        self.num_computed_tokens = num_computed
        self.block_table = seq.block_table  # the target's block ids
        # The draft runner's page table may miss the target step that trimmed the tail and
        # see it regrown with other ids at the same length: a trim resends the row.
        self.block_version = (seq.block_version, seq.block_trims)
        self.pending_token = pending
        self.sampling_params = _GREEDY

    def __len__(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    def __init__(self, runner: DraftModelRunner, max_num_batched_tokens: int):
        self.runner = runner  # over the draft model (greedy, synchronous)
        self.budget = max_num_batched_tokens
        # seq -> (block_version, positions whose draft KV is valid)
        self._computed: weakref.WeakKeyDictionary[Sequence, tuple[int, int]] = (
            weakref.WeakKeyDictionary()
        )
        # Counters (tests, benchmarks): draft runner launches, host waits for draft
        # tokens, tokens computed by catch-up launches.
        self.draft_forwards = 0
        self.host_syncs = 0
        self.catch_up_tokens = 0

    def lookahead(self, seq: Sequence, limit: int) -> int:
        return limit

    def may_propose(self, seq: Sequence) -> bool:
        return True  # every decode drafts: steps never overlap

    def _valid(self, seq: Sequence) -> int:
        version, computed = self._computed.get(seq, (None, 0))
        return computed if version == seq.block_version else 0

    def propose(self, seqs: list[Sequence], counts: list[int]) -> list[list[int]]:
        drafts = self._propose(seqs, counts, on_device=False)
        return [
            drafts.get(s.seq_id, []) if c > 0 else [] for s, c in zip(seqs, counts, strict=True)
        ]

    def propose_on_device(self, seqs: list[Sequence], counts: list[int]):
        """Every sequence drafts counts[0]: the drafts stay on the device (DeviceDrafts),
        unless a long catch-up took several launches (then read, as `propose`)."""
        drafts = self._propose(seqs, counts, on_device=True)
        if isinstance(drafts, DeviceDrafts):
            return drafts
        return [drafts[s.seq_id] for s in seqs]

    def _propose(self, seqs, counts, on_device: bool):
        active = [(s, c) for s, c in zip(seqs, counts, strict=True) if c > 0]
        drafts: dict[int, list[int]] = {s.seq_id: [] for s, _ in active}
        if not active:
            return drafts
        launches = self._catch_up([s for s, _ in active])
        if len(launches) > 1:  # first drafts in several launches: read them now
            self._collect(launches, drafts)
            launches = []
        self._decode_chain(active, drafts, launches)
        if on_device and len(launches) == counts[0]:
            # launch j's row i is draft j + 1 of sequence i: [num_seqs, d] in batch order
            tokens = [handle.device_tokens for _, handle in launches]
            return DeviceDrafts(torch.stack(tokens, dim=1).reshape(-1), counts[0])
        self._collect(launches, drafts)
        return drafts

    def _launch(self, views, num_new):
        decodes = 0
        for view, n in zip(views, num_new, strict=True):
            if n != 1 or len(view) - view.num_computed_tokens != 1:
                break
            decodes += 1
        self.draft_forwards += 1
        # greedy, no logprobs or penalties: no sampling plan to look for
        batch = ScheduledBatch(views, num_new, decodes, needs_sampling_plan=False)
        return self.runner.launch(batch)

    def _collect(self, launches, drafts: dict[int, list[int]]) -> None:
        """Append each launch's tokens to the drafts of the views that sampled them: one
        wait, for the last launch (the device runs a slot's launches in order)."""
        if not launches:
            return
        launches[-1][1].result()
        self.host_syncs += 1
        for views, handle in launches:
            for view, token in zip(views, handle.result(), strict=True):
                drafts[view.seq_id].append(token)

    def _catch_up(self, seqs: list[Sequence]) -> list:
        """Launch the draft KV of every unseen position; returns the launches as (views
        that sampled, handle): each sequence's first draft is in one of them."""
        views = [_DraftView(s, s.token_ids, self._valid(s)) for s in seqs]
        launches = []
        pending = [v for v in views if v.num_computed_tokens < len(v)]
        while pending:
            budget, batch, num_new = self.budget, [], []
            for view in pending:
                if budget == 0:
                    break
                n = min(len(view) - view.num_computed_tokens, budget)
                batch.append(view)
                num_new.append(n)
                budget -= n
            handle = self._launch(batch, num_new)
            self.catch_up_tokens += sum(num_new)
            samplers = []
            for view, n in zip(batch, num_new, strict=True):
                view.num_computed_tokens += n
                if view.num_computed_tokens == len(view):
                    samplers.append(view)
            launches.append((samplers, handle))
            pending = [v for v in pending if v.num_computed_tokens < len(v)]
        for seq, view in zip(seqs, views, strict=True):
            self._computed[seq] = (seq.block_version, view.num_computed_tokens)
        return launches

    def _decode_chain(self, active, drafts: dict[int, list[int]], launches: list) -> None:
        """Drafts 2..d: decode steps whose input is the previous draft, read on the device
        from the previous launch (`drafts` holds the ones already on the host)."""
        rows = {view.seq_id: row for row, view in enumerate(launches[-1][0])} if launches else {}
        for step in range(2, max(c for _, c in active) + 1):
            views = []
            for seq, count in active:
                if count < step:
                    continue
                known = drafts[seq.seq_id]
                ids = seq.token_ids + known + [PLACEHOLDER_TOKEN] * (step - 1 - len(known))
                pending = None
                if len(known) < step - 1:  # the previous draft is still on the device
                    pending = (len(ids) - 1, rows[seq.seq_id])
                views.append(_DraftView(seq, ids, len(ids) - 1, pending))
            launches.append((views, self._launch(views, [1] * len(views))))
            rows = {view.seq_id: row for row, view in enumerate(views)}

    def on_verified(self, seq: Sequence, position: int, num_drafts: int, num_accepted: int):
        self._computed[seq] = (seq.block_version, position + min(num_accepted, num_drafts - 1))


def build_draft_runner(config, draft_hf, num_blocks: int, max_model_len: int) -> DraftModelRunner:
    """The draft model's runner, over the target's `num_blocks` KV block ids. After a
    verify step that kept every draft, the draft catches up on CATCH_UP_TOKENS tokens."""
    config = draft_config(config, num_blocks)
    weights = None
    if config.load_format != "dummy":
        weights = open_model(config.model).weights()
    return DraftModelRunner(config, draft_hf, weights, max_model_len, CATCH_UP_TOKENS)


def draft_config(config, num_blocks: int):
    """The draft runner's Config: the target's, over the draft model and the target's
    number of KV blocks, without speculation of its own."""
    return replace(
        config,
        model=config.speculative_model,
        num_kvcache_blocks=num_blocks,
        speculative_method=None,
        speculative_model=None,
        async_scheduling=False,
    )


def draft_kv_block_bytes(hf_config, block_size: int, dtype_bytes: int) -> int:
    """KV bytes of one block of an MHA draft model (sizes the target's cache budget)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * dtype_bytes * block_size

"""A RunnerSlot: one step's host staging buffers and their fixed device destinations.

The ModelRunner owns one slot per pipeline stage / two-batch-overlap micro-batch. A slot
owns its step buffers (`buffers`, a StepBuffers: atom/model_engine/step_buffers.py), its
publisher (atom/h2d) and its page table; it hands the page table and the SamplingPlan their
own buffers and the publisher, never itself. A step is two calls:

- `prepare` writes numpy views of staged host memory (pinned on CUDA; in packed mode
  straight into the arena) without building torch tensors;
- `publish` queues each buffer at its first consumer's turn, flushes, applies the
  page-table changes, derives the backend's views, and returns a frozen StepInputs.

The device side is allocated once, so CUDA graphs captured on it replay with each step's
data. On CPU with the direct backend the two sides are the same memory.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from atom import profiling
from atom.attention.backend import MHABackend, PagedAttentionBackend
from atom.h2d.slot_buffers import SlotBuffers
from atom.model_engine.page_table import PageTable
from atom.model_engine.sampling.buffers import SamplingBuffers
from atom.model_engine.sampling.plan import SamplingPlan
from atom.model_engine.sampling.sampler import SamplingTensors
from atom.model_engine.sampling.state import SamplingState
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.step_buffers import StepBuffers, StepInputs


@dataclass
class PreparedStep:
    """Host-side facts about the step just staged in a slot."""

    num_seqs: int
    num_tokens: int
    padded_seqs: int | None  # decode CUDA-graph batch size, or None (eager)
    max_seqlen_q: int
    is_decode: bool
    sampling_seqs: list  # sequences that sample this step, in batch order
    all_greedy: bool
    uniform_temperature: float | None  # every sampling row uses it: nothing to upload
    seeded: bool  # some sampling request carries a seed (per-request generators)
    needs_top_k: bool
    needs_top_p: bool
    gathers_logits: bool  # only some rows' hidden states reach the LM head
    num_placeholders: int  # input tokens still on the device (filled from the last step)
    # ...and they are input rows [0, n), taking sampled rows [0, n) of the last step
    placeholders_in_place: bool = False
    # Speculative verification: logits rows of the step (a drafting sequence has one per
    # draft plus one); `draft_token_ids` holds each row's draft (-1: none). 0 = no drafts.
    num_verify_rows: int = 0
    # Logprobs, penalties, logit_bias, grammars... (atom/model_engine/sampling/plan.py); None: plain sampling.
    sampling_plan: SamplingPlan | None = None


@dataclass
class _LastPlan:
    """A slot's last SamplingPlan and its batch key: the next decode step of the same batch
    may run it again with nothing staged."""

    plan: SamplingPlan | None = None
    key: tuple | None = None


class RunnerSlot:
    def __init__(
        self,
        index: int,
        max_num_seqs: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        h2d_backend: str = "direct",
        h2d_checked: bool = True,
        backend: PagedAttentionBackend | None = None,
        max_sampling_rows: int | None = None,
        sampling_state: SamplingState | None = None,
    ):
        self.index = index
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        seqs, tokens = max_num_seqs, max(max_num_tokens, max_num_seqs)
        # logits rows per step: one per sampling sequence, more when drafts are verified
        rows = min(max_sampling_rows or seqs, tokens)
        # Tokens of the state rows built in one step: two whole sequences, or a full
        # step's worth of prompts; larger builds are rare and made directly.
        build_entries = 2 * max(tokens, max_blocks_per_seq * block_size) + 16 * seqs
        self.sampling_state = sampling_state or SamplingState(seqs, vocab_size, device)
        self._last_plan = _LastPlan()
        self.backend = backend or MHABackend()
        family = self.backend.buffer_specs(seqs, tokens)
        specs = [
            *StepBuffers.specs(seqs, tokens, rows, max_blocks_per_seq, vocab_size),
            *SamplingBuffers.specs(rows, tokens, build_entries, vocab_size),
            *family,
        ]
        self.h2d = SlotBuffers(index, device, h2d_backend, specs, checked=h2d_checked)
        self.publisher = self.h2d.publisher
        self._publish = self.publisher.publish
        self._staged = list(self.h2d.buffers.values())  # every one, for the producer guard
        slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.buffers = StepBuffers.of(self.h2d, family, slot_mapping)
        self.page_table = PageTable(
            self.buffers.page_moves,
            self.buffers.page_deltas,
            self.publisher,
            seqs,
            max_blocks_per_seq,
            device,
            checked=h2d_checked,
        )
        self._sampling: dict[tuple, SamplingTensors] = {}

    def wait_for_transfers(self) -> None:
        """Block until the previous step's host-to-device copies have executed."""
        self.publisher.wait_for_transfers()

    # -- host side -------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch, padded_seqs: int | None = None) -> PreparedStep:
        """Stage the batch's metadata in host memory (numpy only, under the producer guard).

        `padded_seqs` (decode only) is the CUDA-graph batch size the step will replay at;
        buffers the graph reads are staged at that length so publication can pad them.
        """
        with self.publisher.producer_guard(self._staged):
            return self._prepare(batch, padded_seqs)

    def _prepare(self, batch: ScheduledBatch, padded_seqs: int | None) -> PreparedStep:
        stage, buffers = self.publisher.stage, self.buffers
        seqs = batch.seqs
        num_seqs = len(seqs)
        padded = padded_seqs or num_seqs
        decode = batch.is_decode_only  # one token a row
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, num_seqs)
        if decode:  # the tokens are the rows: no per-row counts to sum
            num_new = None
            ends = starts + 1
            num_tokens, max_seqlen_q = num_seqs, 1
        else:
            num_new = np.asarray(batch.num_new_tokens, dtype=np.int64)
            ends = starts + num_new
            num_tokens = int(num_new.sum())
            max_seqlen_q = int(num_new.max())
        padded_tokens = padded_seqs or num_tokens

        self.page_table.sync(seqs, batch.layout, batch.grown or (), batch.step)

        drafts = batch.draft_token_ids  # speculative: tokens to verify after the last one
        if decode:
            cu = None  # cu_seqlens would be 0..n (built where a sampling plan needs them)
            positions = starts
            ids = np.fromiter((s.token_ids[-1] for s in seqs), np.int64, num_seqs)
        else:
            cu = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(num_new, out=cu[1:])
            stage(buffers.cu_seqlens_q, num_seqs + 1)[:] = cu
            positions = np.arange(num_tokens) + np.repeat(starts - cu[:num_seqs], num_new)
            pieces = (
                s.token_ids[a:b]
                for s, a, b in zip(seqs, starts.tolist(), ends.tolist(), strict=True)
            )
            if drafts is not None:
                pieces = (p + d for p, d in zip(pieces, drafts, strict=True))
            ids = np.fromiter(itertools.chain.from_iterable(pieces), np.int64, num_tokens)
        placeholders = [
            (row, seq.pending_token[1])
            for row, seq in enumerate(seqs)
            if seq.pending_token is not None
        ]
        placeholders_in_place = False
        if placeholders:
            rows_, src = zip(*placeholders, strict=True)
            n = len(rows_)
            dst = rows_ if decode else cu[1:][list(rows_)] - 1  # each row's last token
            # Steady decode: placeholder k is token k (rows 0..n-1, increasing, of one
            # token each) and takes token k of the last step. The fill is then one device
            # copy of a prefix, and the (dst, src) pairs need no upload.
            placeholders_in_place = rows_[-1] == n - 1 and dst[-1] == n - 1 and src == rows_
            if not placeholders_in_place:
                stage(buffers.placeholder_dst, n)[:] = dst
                stage(buffers.placeholder_src, n)[:] = src
            np.maximum(ids, 0, out=ids)  # keep the host copy a valid token id
        elif batch.device_drafts is not None:  # drafts filled on the device
            np.maximum(ids, 0, out=ids)
        stage(buffers.input_ids, padded_tokens)[:num_tokens] = ids
        stage(buffers.positions, padded_tokens)[:num_tokens] = positions
        stage(buffers.context_lens, padded)[:num_seqs] = ends
        self.backend.stage(self, seqs, stage)

        num_verify_rows = 0
        if batch.is_decode_only:  # every row computes its last token: every row samples
            sampling_seqs = seqs
            gathers_logits = False
        elif drafts is not None:
            sampling_seqs, gathers_logits, num_verify_rows = self._stage_verify_rows(
                seqs, drafts, ends, cu, num_tokens
            )
        else:
            lengths = np.fromiter((len(s.token_ids) for s in seqs), np.int64, num_seqs)
            sample_rows = np.flatnonzero(ends == lengths)
            sampling_seqs = [seqs[i] for i in sample_rows.tolist()]
            # Eager steps gather the sampling rows unless every token samples.
            gathers_logits = len(sample_rows) > 0 and len(sample_rows) != num_tokens
            if gathers_logits:
                stage(buffers.logits_indices, len(sample_rows))[:] = cu[sample_rows + 1] - 1
        params = [s.sampling_params for s in sampling_seqs]
        temperatures = {p.temperature for p in params}
        all_greedy = temperatures <= {0.0}
        needs_top_k = needs_top_p = False
        uniform_temperature = None
        if not all_greedy:
            n = len(params)
            needs_top_k = any(p.top_k > 0 for p in params)
            needs_top_p = any(p.top_p < 1.0 for p in params)
            if len(temperatures) == 1:
                uniform_temperature = temperatures.pop()
            else:
                stage(buffers.temperatures, n)[:] = [p.temperature for p in params]
            if needs_top_k:
                stage(buffers.top_k, n)[:] = [
                    p.top_k if p.top_k > 0 else self.vocab_size for p in params
                ]
            if needs_top_p:
                stage(buffers.top_p, n)[:] = [p.top_p for p in params]
        plan = self._stage_sampling_plan(batch, sampling_seqs, cu, ends)
        return PreparedStep(
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            padded_seqs=padded_seqs,
            max_seqlen_q=max_seqlen_q,
            is_decode=batch.is_decode_only,
            sampling_seqs=sampling_seqs,
            all_greedy=all_greedy,
            uniform_temperature=uniform_temperature,
            seeded=not all_greedy and any(p.seed is not None for p in params),
            needs_top_k=needs_top_k,
            needs_top_p=needs_top_p,
            gathers_logits=gathers_logits,
            num_placeholders=len(placeholders),
            placeholders_in_place=placeholders_in_place,
            num_verify_rows=num_verify_rows,
            sampling_plan=plan,
        )

    def _stage_sampling_plan(self, batch, sampling_seqs, cu, ends) -> SamplingPlan | None:
        """The step's SamplingPlan: the previous step's again when this decode batch is the
        same (layout, consecutive steps both decode-only, so the same sampling rows; no state
        row taken back since), else staged anew."""
        last = self._last_plan
        previous, key = last.plan, last.key
        last.plan = last.key = None
        if batch.needs_sampling_plan is False:
            return None
        epoch = self.sampling_state.epoch
        if (
            previous is not None
            and previous.reusable
            and batch.is_decode_only
            and batch.layout is not None
            and batch.step is not None
            and key == (batch.layout, batch.step - 1, epoch, True)  # both decode-only
        ):
            plan = previous.again()
        else:
            if cu is None:  # a decode step: token k is row k
                cu = np.arange(len(batch.seqs) + 1, dtype=np.int64)
            plan = SamplingPlan.stage(
                self.buffers.sampling, self.sampling_state, batch, sampling_seqs, cu, ends
            )
        if plan is not None and batch.layout is not None and batch.step is not None:
            last.plan = plan
            epoch = self.sampling_state.epoch
            last.key = (batch.layout, batch.step, epoch, batch.is_decode_only)
        return plan

    def _stage_verify_rows(self, seqs, drafts, ends, cu, num_tokens):
        """Logits rows of a step with drafts: a sampling sequence with d drafts reads its
        last d + 1 rows (the last real token's and each draft's); row j is checked against
        draft j + 1, its last row against nothing (-1). Returns (sampling sequences, one
        entry per row; whether the LM head gathers rows; number of rows)."""
        stage, buffers = self.publisher.stage, self.buffers
        counts = np.fromiter((len(d) for d in drafts), np.int64, len(seqs))
        lengths = np.fromiter((len(s.token_ids) for s in seqs), np.int64, len(seqs))
        sample = np.flatnonzero(ends - counts == lengths).tolist()
        sampling_seqs, rows, checked = [], [], []
        for i in sample:
            d = int(counts[i])
            last = int(cu[i + 1]) - 1
            sampling_seqs += [seqs[i]] * (d + 1)
            rows.extend(range(last - d, last + 1))
            checked += drafts[i]
            checked.append(-1)
        n = len(rows)
        gathers_logits = n > 0 and n != num_tokens
        if gathers_logits:
            stage(buffers.logits_indices, n)[:] = rows
        stage(buffers.draft_token_ids, n)[:] = checked
        return sampling_seqs, gathers_logits, n

    # -- publication ------------------------------------------------------------------------
    def publish(self, step: PreparedStep) -> StepInputs:
        """Publish the step staged by `prepare` and return its device inputs.

        Each input is queued at its first consumer's turn (embedding, attention metadata,
        placeholders, sampler, LM head, verification, sampling plan), then the step's group
        is flushed (packed: one copy + one scatter), the page-table changes are applied and
        the backend derives its views on the device. Nothing published here is read before
        this returns.
        """
        queued = self._queue(step)
        with profiling.stage("publish"):
            event = self._flush(step)
        return StepInputs(**queued, event=event)

    def _queue(self, step: PreparedStep) -> dict:
        """Queue every publication of `step` with the publisher, in first-consumer order;
        the views they return, by StepInputs field."""
        publish, buffers = self._publish, self.buffers
        tokens = step.num_tokens
        padded_tokens = step.padded_seqs or tokens
        with profiling.stage("publish.embedding"):
            input_ids = publish(buffers.input_ids, tokens, padded_tokens)
        with profiling.stage("publish.attention_metadata"):
            positions = publish(buffers.positions, tokens, padded_tokens)
            metadata = self.backend.build_metadata(self, step, publish)
        placeholders = None
        if step.num_placeholders:
            placeholders = (None, None)  # in place: input_ids[:n] = the last step's [:n]
            if not step.placeholders_in_place:
                n = step.num_placeholders
                with profiling.stage("publish.placeholders"):
                    placeholders = (
                        publish(buffers.placeholder_dst, n),
                        publish(buffers.placeholder_src, n),
                    )
        sampling = self._publish_sampling(step) if step.sampling_seqs else None
        logits_indices = None
        if step.gathers_logits:
            with profiling.stage("publish.logits_indices"):
                logits_indices = publish(buffers.logits_indices, len(step.sampling_seqs))
        draft_token_ids = None
        if step.num_verify_rows:
            with profiling.stage("publish.verify"):
                draft_token_ids = publish(buffers.draft_token_ids, step.num_verify_rows)
        plan = step.sampling_plan
        if plan is not None:
            with profiling.stage("publish.sampler"):
                plan.publish(buffers.sampling)
        return dict(
            input_ids=input_ids,
            positions=positions,
            metadata=metadata,
            placeholders=placeholders,
            sampling=sampling,
            logits_indices=logits_indices,
            draft_token_ids=draft_token_ids,
            sampling_plan=plan,
        )

    def _flush(self, step: PreparedStep):
        """Send everything queued for `step`, then apply the page-table changes and derive
        the backend's views on the device (decode graphs derive their own)."""
        event = self.publisher.flush()
        self.page_table.on_published()
        if step.padded_seqs is None:
            self.backend.derive_views(self, step.num_tokens, step.num_seqs, step.is_decode)
        return event

    def _publish_sampling(self, step: PreparedStep) -> SamplingTensors:
        """Sampling parameters; uniform all-greedy steps upload nothing."""
        if step.all_greedy:
            return SamplingTensors(all_greedy=True)
        publish, buffers = self._publish, self.buffers
        n = len(step.sampling_seqs)
        uniform = step.uniform_temperature
        with profiling.stage("publish.sampler"):
            temperatures = None if uniform is not None else publish(buffers.temperatures, n)
            top_k = publish(buffers.top_k, n) if step.needs_top_k else None
            top_p = publish(buffers.top_p, n) if step.needs_top_p else None
        if step.seeded:
            generators = [_generator_of(s, self.device) for s in step.sampling_seqs]
            return SamplingTensors(
                False, uniform, temperatures, top_k, top_p, step.needs_top_k, step.needs_top_p,
                generators,
            )  # fmt: skip
        # Without seeds the same views come back at a given size: reuse the object.
        key = (n, uniform, step.needs_top_k, step.needs_top_p)
        tensors = self._sampling.get(key)
        if tensors is None:
            if len(self._sampling) > 1024:
                self._sampling.clear()
            tensors = self._sampling[key] = SamplingTensors(
                False, uniform, temperatures, top_k, top_p, step.needs_top_k, step.needs_top_p
            )
        return tensors


def _generator_of(seq, device: torch.device) -> torch.Generator | None:
    """The seeded generator of a request, created on first use and kept on the sequence."""
    seed = seq.sampling_params.seed
    if seed is None:
        return None
    generator = getattr(seq, "generator", None)
    if generator is None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        seq.generator = generator
    return generator

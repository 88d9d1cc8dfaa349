"""A RunnerSlot: one step's host staging buffers and their fixed device destinations.

The ModelRunner owns one slot per pipeline stage / two-batch-overlap micro-batch. A slot
owns its staged buffers, its publisher (atom/h2d) and its page table. `prepare` writes
numpy views of staged host memory (pinned on CUDA; in packed mode straight into the
arena) without building torch tensors; the device side is allocated once, so CUDA graphs
captured on it replay with each step's data. On CPU with the direct backend the two
sides are the same memory.

Each buffer declares its pad value, so a padded batch (CUDA-graph replay at a larger
batch size) reads well-defined data: context lengths 0 (attend to nothing), cu_seqlens
repeat their last value; the slot mapping, derived on the device from the page table,
is -1 (write nothing) in padded rows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from atom import profiling
from atom.attention.backend import MHABackend, PagedAttentionBackend
from atom.h2d.contract import REPEAT_LAST
from atom.h2d.slot_buffers import BufferSpec, SlotBuffers
from atom.model_engine.page_table import PageTable
from atom.model_engine.sampling.plan import SamplingPlan
from atom.model_engine.sampling.sampler import SamplingTensors
from atom.model_engine.sampling.state import SamplingState
from atom.model_engine.scheduler import ScheduledBatch


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
        self._plan: SamplingPlan | None = None  # the last step's, with its batch key
        self._plan_key: tuple | None = None
        self.backend = backend or MHABackend()
        specs = [
            BufferSpec("input_ids", (tokens,), torch.int64, 0),
            BufferSpec("positions", (tokens,), torch.int64, 0),
            BufferSpec("context_lens", (seqs,), torch.int32, 0),
            BufferSpec("cu_seqlens_q", (seqs + 1,), torch.int32, REPEAT_LAST),
            # Page-table changes (atom/model_engine/page_table.py), only what changed
            # since the slot's last step: row moves [n | sources | destinations | lengths],
            # then (row, start, block ids) deltas [n | rows | starts | offsets | ids].
            BufferSpec("page_moves", (1 + 3 * seqs,), torch.int32, 0),
            BufferSpec("page_deltas", (3 * seqs + 2 + seqs * max_blocks_per_seq,), torch.int32, 0),
            BufferSpec("logits_indices", (rows,), torch.int64, 0),
            BufferSpec("temperatures", (rows,), torch.float32, 0.0),
            BufferSpec("top_k", (rows,), torch.int64, vocab_size),
            BufferSpec("top_p", (rows,), torch.float32, 1.0),
            # Speculative verification: the draft each logits row is checked against.
            BufferSpec("draft_token_ids", (rows,), torch.int64, -1),
            # Placeholder fix-ups (asynchronous scheduling): input_ids[dst] = last_sampled[src].
            BufferSpec("placeholder_dst", (seqs,), torch.int64, 0),
            BufferSpec("placeholder_src", (seqs,), torch.int64, 0),
            # Sampling plans (atom/model_engine/sampling/plan.py): the SamplingState row of each sampling row,
            # builds of state rows new this step (row, min_tokens, outputs, bias entries,
            # stop ids | presence, frequency, repetition | (row, column, token) entries of
            # prompt, output, bias and stop tokens | bias values), the grammar bitmask,
            # logprob rows and prompt-logprob (hidden row, target token) pairs.
            BufferSpec("sampling_state_rows", (rows,), torch.int32, 0),
            BufferSpec("state_build_ints", (rows, 5), torch.int32, 0),
            BufferSpec("state_build_floats", (rows, 3), torch.float32, 0.0),
            BufferSpec("state_build_entries", (build_entries, 3), torch.int32, 0),
            BufferSpec("state_build_values", (build_entries,), torch.float32, 0.0),
            BufferSpec("token_bitmask", (rows, -(-vocab_size // 32)), torch.int32, -1, False),
            BufferSpec("logprob_rows", (rows,), torch.int64, 0),
            BufferSpec("prompt_logprob_rows", (tokens,), torch.int64, 0),
            BufferSpec("prompt_logprob_targets", (tokens,), torch.int64, 0),
            *self.backend.buffer_specs(seqs, tokens),
        ]
        self.h2d = SlotBuffers(index, device, h2d_backend, specs, checked=h2d_checked)
        self.publisher = self.h2d.publisher
        self._publish = self.publisher.publish
        self._buffers = list(self.h2d.buffers.values())
        for name, buffer in self.h2d.buffers.items():
            setattr(self, name, buffer)
        self.page_table = PageTable(self, seqs, max_blocks_per_seq, device, checked=h2d_checked)
        # Derived on the device from the page table (backend.derive_views), never uploaded;
        # -1 (write nothing) wherever a padded CUDA-graph batch has no token.
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self._derive: PreparedStep | None = None
        self._sampling: dict[tuple, SamplingTensors] = {}

    def wait_for_transfers(self) -> None:
        """Block until the previous step's host-to-device copies have executed."""
        self.publisher.wait_for_transfers()

    def flush(self):
        """Send everything published for this step (packed: one copy + one scatter), then
        apply the page-table deltas and derive the backend's views on the device."""
        derive, self._derive = self._derive, None
        event = self.publisher.flush()
        self.page_table.on_published()
        if derive is not None and derive.padded_seqs is None:  # graphs derive their own
            self.backend.derive_views(self, derive.num_tokens, derive.num_seqs, derive.is_decode)
        return event

    # -- host side -------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch, padded_seqs: int | None = None) -> PreparedStep:
        """Stage the batch's metadata in host memory (numpy only, under the producer guard).

        `padded_seqs` (decode only) is the CUDA-graph batch size the step will replay at;
        buffers the graph reads are staged at that length so publication can pad them.
        """
        with self.publisher.producer_guard(self._buffers):
            return self._prepare(batch, padded_seqs)

    def _prepare(self, batch: ScheduledBatch, padded_seqs: int | None) -> PreparedStep:
        stage = self.publisher.stage
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
            stage(self.cu_seqlens_q, num_seqs + 1)[:] = cu
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
                stage(self.placeholder_dst, n)[:] = dst
                stage(self.placeholder_src, n)[:] = src
            np.maximum(ids, 0, out=ids)  # keep the host copy a valid token id
        elif batch.device_drafts is not None:  # drafts filled on the device
            np.maximum(ids, 0, out=ids)
        stage(self.input_ids, padded_tokens)[:num_tokens] = ids
        stage(self.positions, padded_tokens)[:num_tokens] = positions
        stage(self.context_lens, padded)[:num_seqs] = ends
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
                stage(self.logits_indices, len(sample_rows))[:] = cu[sample_rows + 1] - 1
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
                stage(self.temperatures, n)[:] = [p.temperature for p in params]
            if needs_top_k:
                stage(self.top_k, n)[:] = [
                    p.top_k if p.top_k > 0 else self.vocab_size for p in params
                ]
            if needs_top_p:
                stage(self.top_p, n)[:] = [p.top_p for p in params]
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
        previous, key = self._plan, self._plan_key
        self._plan = None
        self._plan_key = None
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
            plan = SamplingPlan.stage(self, batch, sampling_seqs, cu, ends)
        if plan is not None and batch.layout is not None and batch.step is not None:
            self._plan = plan
            epoch = self.sampling_state.epoch
            self._plan_key = (batch.layout, batch.step, epoch, batch.is_decode_only)
        return plan

    def stage_builds(self, rows: int, entries: int):
        """Views for SamplingState.stage_builds: (ints, floats, entries, values), or None
        when `entries` exceeds the slot's staging."""
        if entries > self.state_build_entries.capacity:
            return None
        stage = self.publisher.stage
        return (
            stage(self.state_build_ints, rows),
            stage(self.state_build_floats, rows),
            stage(self.state_build_entries, entries),
            stage(self.state_build_values, entries),
        )

    def _stage_verify_rows(self, seqs, drafts, ends, cu, num_tokens):
        """Logits rows of a step with drafts: a sampling sequence with d drafts reads its
        last d + 1 rows (the last real token's and each draft's); row j is checked against
        draft j + 1, its last row against nothing (-1). Returns (sampling sequences, one
        entry per row; whether the LM head gathers rows; number of rows)."""
        stage = self.publisher.stage
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
            stage(self.logits_indices, n)[:] = rows
        stage(self.draft_token_ids, n)[:] = checked
        return sampling_seqs, gathers_logits, n

    # -- publication at the first consumer -------------------------------------------------
    def publish_model_inputs(self, step: PreparedStep):
        """Embedding lookup and attention metadata: (input_ids, positions, metadata)."""
        tokens = step.num_tokens
        padded_tokens = step.padded_seqs or tokens
        with profiling.stage("publish.embedding"):
            input_ids = self._publish(self.input_ids, tokens, padded_tokens)
        with profiling.stage("publish.attention_metadata"):
            positions = self._publish(self.positions, tokens, padded_tokens)
            metadata = self.backend.build_metadata(self, step, self._publish)
            self._derive = step
        return input_ids, positions, metadata

    def publish_placeholders(self, step: PreparedStep):
        """(dst, src) device index tensors of the placeholder fix-ups, (None, None) when
        they are in place (input_ids[:n] = the last step's tokens[:n]), or None."""
        if not step.num_placeholders:
            return None
        if step.placeholders_in_place:
            return None, None
        n = step.num_placeholders
        with profiling.stage("publish.placeholders"):
            return self._publish(self.placeholder_dst, n), self._publish(self.placeholder_src, n)

    def publish_draft_tokens(self, step: PreparedStep) -> torch.Tensor | None:
        """The draft each logits row is verified against (speculative steps), or None."""
        if not step.num_verify_rows:
            return None
        with profiling.stage("publish.verify"):
            return self._publish(self.draft_token_ids, step.num_verify_rows)

    def publish_logits_indices(self, step: PreparedStep) -> torch.Tensor | None:
        """Rows of the hidden states the LM head reads, or None when it reads all."""
        if not step.gathers_logits:
            return None
        with profiling.stage("publish.logits_indices"):
            return self._publish(self.logits_indices, len(step.sampling_seqs))

    def publish_sampling_plan(self, step: PreparedStep) -> SamplingPlan | None:
        """The step's SamplingPlan with its device views (None: plain sampling)."""
        plan = step.sampling_plan
        if plan is not None:
            with profiling.stage("publish.sampler"):
                plan.publish(self)
        return plan

    def publish_sampling(self, step: PreparedStep) -> SamplingTensors:
        """Sampling parameters; uniform all-greedy steps upload nothing."""
        if step.all_greedy:
            return SamplingTensors(all_greedy=True)
        n = len(step.sampling_seqs)
        uniform = step.uniform_temperature
        with profiling.stage("publish.sampler"):
            temperatures = None if uniform is not None else self._publish(self.temperatures, n)
            top_k = self._publish(self.top_k, n) if step.needs_top_k else None
            top_p = self._publish(self.top_p, n) if step.needs_top_p else None
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

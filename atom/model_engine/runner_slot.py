"""A RunnerSlot: one step's host staging buffers and their fixed device destinations.

The ModelRunner owns one slot per pipeline stage / two-batch-overlap micro-batch. The
host side of every buffer is a numpy view of (pinned, on CUDA) memory that `prepare`
writes without building torch tensors; the device side is allocated once, so CUDA graphs
captured on it replay with each step's data. On CPU the two sides are the same memory.

Each buffer declares its pad value, so a padded batch (CUDA-graph replay at a larger
batch size) reads well-defined data: slot mapping -1 (write nothing), context lengths 0
(attend to nothing), cu_seqlens repeat their last value.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from atom.forward_context import AttentionMetadata
from atom.h2d.contract import REPEAT_LAST
from atom.h2d.slot_buffers import BufferSpec, SlotBuffers
from atom.model_engine.sampler import SamplingTensors
from atom.model_engine.scheduler import ScheduledBatch


@dataclass
class PreparedStep:
    """Host-side facts about the step just written into a slot's staging buffers."""

    num_seqs: int
    num_tokens: int
    max_seqlen_q: int
    is_decode: bool
    sampling_seqs: list  # sequences that sample this step, in batch order
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    num_placeholders: int  # input tokens still on the device (filled from the last step)


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
    ):
        self.index = index
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        seqs, tokens = max_num_seqs, max(max_num_tokens, max_num_seqs)
        specs = [
            BufferSpec("input_ids", (tokens,), torch.int64, 0),
            BufferSpec("positions", (tokens,), torch.int64, 0),
            BufferSpec("slot_mapping", (tokens,), torch.int64, -1),
            BufferSpec("context_lens", (seqs,), torch.int32, 0),
            BufferSpec("cu_seqlens_q", (seqs + 1,), torch.int32, REPEAT_LAST),
            BufferSpec("block_tables", (seqs, max_blocks_per_seq), torch.int32, 0),
            BufferSpec("logits_indices", (seqs,), torch.int64, 0),
            BufferSpec("temperatures", (seqs,), torch.float32, 0.0),
            BufferSpec("top_k", (seqs,), torch.int64, vocab_size),
            BufferSpec("top_p", (seqs,), torch.float32, 1.0),
            # Placeholder fix-ups (asynchronous scheduling): input_ids[dst] = last_sampled[src].
            BufferSpec("placeholder_dst", (seqs,), torch.int64, 0),
            BufferSpec("placeholder_src", (seqs,), torch.int64, 0),
        ]
        self.h2d = SlotBuffers(index, device, h2d_backend, specs, checked=h2d_checked)
        self.publisher = self.h2d.publisher
        for name, buffer in self.h2d.buffers.items():
            setattr(self, name, buffer)

    def wait_for_transfers(self) -> None:
        """Block until the previous step's host-to-device copies have executed."""
        self.publisher.wait_for_transfers()

    def flush(self) -> None:
        """Send everything published for this step (packed: one copy + one scatter)."""
        self.publisher.flush()

    # -- host side -------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        """Write the batch's metadata into the host staging buffers (numpy only)."""
        with self.publisher.producer_guard(list(self.h2d.buffers.values())):
            return self._prepare(batch)

    def _prepare(self, batch: ScheduledBatch) -> PreparedStep:
        seqs = batch.seqs
        num_seqs = len(seqs)
        bs = self.block_size
        num_new = np.asarray(batch.num_new_tokens, dtype=np.int64)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, num_seqs)
        ends = starts + num_new
        num_tokens = int(num_new.sum())

        tables = self.block_tables.array
        for row, seq in enumerate(seqs):
            tables[row, : len(seq.block_table)] = seq.block_table

        cu = self.cu_seqlens_q.array
        cu[0] = 0
        np.cumsum(num_new, out=cu[1 : num_seqs + 1])
        if batch.is_decode_only:
            rows = np.arange(num_seqs)
            positions = starts
            ids = np.fromiter((s.token_ids[-1] for s in seqs), np.int64, num_seqs)
        else:
            rows = np.repeat(np.arange(num_seqs), num_new)
            positions = np.arange(num_tokens) + np.repeat(starts - cu[:num_seqs], num_new)
            ids = np.fromiter(
                itertools.chain.from_iterable(
                    s.token_ids[a:b]
                    for s, a, b in zip(seqs, starts.tolist(), ends.tolist(), strict=True)
                ),
                np.int64,
                num_tokens,
            )
        placeholders = [
            (row, seq.pending_token[1])
            for row, seq in enumerate(seqs)
            if seq.pending_token is not None
        ]
        if placeholders:
            rows_, src = zip(*placeholders, strict=True)
            last_token_rows = cu[1 : num_seqs + 1] - 1
            self.placeholder_dst.array[: len(rows_)] = last_token_rows[list(rows_)]
            self.placeholder_src.array[: len(src)] = src
            np.maximum(ids, 0, out=ids)  # keep the host copy a valid token id
        self.input_ids.array[:num_tokens] = ids
        self.positions.array[:num_tokens] = positions
        self.slot_mapping.array[:num_tokens] = tables[rows, positions // bs] * bs + positions % bs
        self.context_lens.array[:num_seqs] = ends

        lengths = np.fromiter((len(s) for s in seqs), np.int64, num_seqs)
        samples = ends == lengths
        sample_rows = np.flatnonzero(samples)
        sampling_seqs = [seqs[i] for i in sample_rows.tolist()]
        self.logits_indices.array[: len(sample_rows)] = cu[sample_rows + 1] - 1
        params = [s.sampling_params for s in sampling_seqs]
        all_greedy = all(p.temperature == 0.0 for p in params)
        needs_top_k = needs_top_p = False
        if not all_greedy:
            n = len(params)
            self.temperatures.array[:n] = [p.temperature for p in params]
            self.top_k.array[:n] = [p.top_k if p.top_k > 0 else self.vocab_size for p in params]
            self.top_p.array[:n] = [p.top_p for p in params]
            needs_top_k = any(p.top_k > 0 for p in params)
            needs_top_p = any(p.top_p < 1.0 for p in params)
        return PreparedStep(
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            max_seqlen_q=int(num_new.max()),
            is_decode=batch.is_decode_only,
            sampling_seqs=sampling_seqs,
            all_greedy=all_greedy,
            needs_top_k=needs_top_k,
            needs_top_p=needs_top_p,
            num_placeholders=len(placeholders),
        )

    # -- publication -----------------------------------------------------------------------
    def publish_model_inputs(self, step: PreparedStep, padded_seqs: int | None = None):
        """Send the forward's inputs; returns (input_ids, positions, attention metadata).

        `padded_seqs` (decode only) pads the batch to a captured CUDA-graph size.
        """
        tokens, seqs = step.num_tokens, step.num_seqs
        padded_tokens = padded_seqs if padded_seqs is not None else tokens
        padded = padded_seqs if padded_seqs is not None else seqs
        input_ids = self._publish(self.input_ids, tokens, padded_tokens)
        positions = self._publish(self.positions, tokens, padded_tokens)
        metadata = AttentionMetadata(
            slot_mapping=self._publish(self.slot_mapping, tokens, padded_tokens),
            context_lens=self._publish(self.context_lens, seqs, padded),
            block_tables=self._publish(self.block_tables, seqs, padded),
            cu_seqlens_q=None if step.is_decode else self._publish(self.cu_seqlens_q, seqs + 1),
            max_seqlen_q=step.max_seqlen_q,
            is_decode=step.is_decode,
        )
        return input_ids, positions, metadata

    def _publish(self, buffer, valid: int, padded: int | None = None) -> torch.Tensor:
        return self.publisher.publish(buffer, valid, padded)

    def publish_placeholders(self, step: PreparedStep):
        """(dst, src) device index tensors of the placeholder fix-ups, or None."""
        if not step.num_placeholders:
            return None
        n = step.num_placeholders
        return self._publish(self.placeholder_dst, n), self._publish(self.placeholder_src, n)

    def publish_logits_indices(self, step: PreparedStep) -> torch.Tensor:
        return self._publish(self.logits_indices, len(step.sampling_seqs))

    def publish_sampling(self, step: PreparedStep) -> SamplingTensors:
        """Sampling parameters; all-greedy steps upload nothing."""
        if step.all_greedy:
            return SamplingTensors(all_greedy=True)
        n = len(step.sampling_seqs)
        generators = [_generator_of(s, self.device) for s in step.sampling_seqs]
        return SamplingTensors(
            all_greedy=False,
            temperatures=self._publish(self.temperatures, n),
            top_k=self._publish(self.top_k, n) if step.needs_top_k else None,
            top_p=self._publish(self.top_p, n) if step.needs_top_p else None,
            needs_top_k=step.needs_top_k,
            needs_top_p=step.needs_top_p,
            generators=generators if any(g is not None for g in generators) else None,
        )


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

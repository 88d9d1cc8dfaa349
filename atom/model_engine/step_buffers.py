"""A runner slot's step buffers, declared by name, and what publishing a step returns.

`StepBuffers` holds one field per staged buffer (atom/h2d: host staging memory plus a fixed
device destination, so CUDA graphs captured on them replay with each step's data). Each
owner gets its share and nothing more: the page table its `page_moves` / `page_deltas`,
the SamplingPlan its `SamplingBuffers`, the attention backend the buffers it declared
(`backend.buffer_specs`, in `family`). `StepInputs` is what `RunnerSlot.publish` returns
once the step's group is flushed: the device views each consumer reads.

Each buffer declares its pad value, so a padded batch (CUDA-graph replay at a larger
batch size) reads well-defined data: context lengths 0 (attend to nothing), cu_seqlens
repeat their last value; the slot mapping, derived on the device from the page table,
is -1 (write nothing) in padded rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.forward_context import AttentionMetadata
from atom.h2d.contract import REPEAT_LAST, StagedBuffer, TransferEvent
from atom.h2d.slot_buffers import BufferSpec, SlotBuffers
from atom.model_engine.sampling.buffers import SamplingBuffers
from atom.model_engine.sampling.plan import SamplingPlan
from atom.model_engine.sampling.sampler import SamplingTensors


@dataclass(frozen=True)
class StepBuffers:
    input_ids: StagedBuffer  # [tokens] int64
    positions: StagedBuffer  # [tokens] int64
    context_lens: StagedBuffer  # [seqs] int32, pad 0: a padded row attends to nothing
    cu_seqlens_q: StagedBuffer  # [seqs + 1] int32, pad: repeat the last value
    # Page-table changes (atom/model_engine/page_table.py), only what changed since the
    # slot's last step: row moves [n | sources | destinations | lengths], then
    # (row, start, block ids) deltas [n | rows | starts | offsets | ids].
    page_moves: StagedBuffer  # [1 + 3 * seqs] int32
    page_deltas: StagedBuffer  # [3 * seqs + 2 + seqs * max_blocks_per_seq] int32
    logits_indices: StagedBuffer  # [rows] int64, hidden rows the LM head reads
    temperatures: StagedBuffer  # [rows] float32
    top_k: StagedBuffer  # [rows] int64, pad vocab_size (no cut)
    top_p: StagedBuffer  # [rows] float32, pad 1.0 (no cut)
    # Speculative verification: the draft each logits row is checked against (-1: none).
    draft_token_ids: StagedBuffer  # [rows] int64
    # Placeholder fix-ups (asynchronous scheduling): input_ids[dst] = last_sampled[src].
    placeholder_dst: StagedBuffer  # [seqs] int64
    placeholder_src: StagedBuffer  # [seqs] int64
    sampling: SamplingBuffers  # the SamplingPlan's (sampling/buffers.py)
    family: dict[str, StagedBuffer]  # the attention backend's own (its buffer_specs)
    # Derived on the device from the page table (backend.derive_views), never uploaded;
    # -1 (write nothing) wherever a padded CUDA-graph batch has no token.
    slot_mapping: torch.Tensor  # [tokens] int64

    @staticmethod
    def specs(
        seqs: int, tokens: int, rows: int, max_blocks_per_seq: int, vocab_size: int
    ) -> list[BufferSpec]:
        """The staged buffers every backend shares (`sampling` and `family` excluded)."""
        return [
            BufferSpec("input_ids", (tokens,), torch.int64, 0),
            BufferSpec("positions", (tokens,), torch.int64, 0),
            BufferSpec("context_lens", (seqs,), torch.int32, 0),
            BufferSpec("cu_seqlens_q", (seqs + 1,), torch.int32, REPEAT_LAST),
            BufferSpec("page_moves", (1 + 3 * seqs,), torch.int32, 0),
            BufferSpec("page_deltas", (3 * seqs + 2 + seqs * max_blocks_per_seq,), torch.int32, 0),
            BufferSpec("logits_indices", (rows,), torch.int64, 0),
            BufferSpec("temperatures", (rows,), torch.float32, 0.0),
            BufferSpec("top_k", (rows,), torch.int64, vocab_size),
            BufferSpec("top_p", (rows,), torch.float32, 1.0),
            BufferSpec("draft_token_ids", (rows,), torch.int64, -1),
            BufferSpec("placeholder_dst", (seqs,), torch.int64, 0),
            BufferSpec("placeholder_src", (seqs,), torch.int64, 0),
        ]

    @classmethod
    def of(
        cls, h2d: SlotBuffers, family: list[BufferSpec], slot_mapping: torch.Tensor
    ) -> StepBuffers:
        """The slot's buffers, by name, from its allocation (`h2d`)."""
        b = h2d.buffers
        return cls(
            input_ids=b["input_ids"],
            positions=b["positions"],
            context_lens=b["context_lens"],
            cu_seqlens_q=b["cu_seqlens_q"],
            page_moves=b["page_moves"],
            page_deltas=b["page_deltas"],
            logits_indices=b["logits_indices"],
            temperatures=b["temperatures"],
            top_k=b["top_k"],
            top_p=b["top_p"],
            draft_token_ids=b["draft_token_ids"],
            placeholder_dst=b["placeholder_dst"],
            placeholder_src=b["placeholder_src"],
            sampling=SamplingBuffers.of(b, h2d.publisher),
            family={spec.name: b[spec.name] for spec in family},
            slot_mapping=slot_mapping,
        )


@dataclass(frozen=True)
class StepInputs:
    """A published step: device views, current once the flush that made them has run."""

    input_ids: torch.Tensor  # [padded tokens]
    positions: torch.Tensor
    metadata: AttentionMetadata  # the backend's (build_metadata)
    # Placeholder fix-ups: None (none), (None, None) (in place: input_ids[:n] = the last
    # step's tokens[:n]) or (dst, src) device index tensors.
    placeholders: tuple | None
    sampling: SamplingTensors | None  # None: no row samples this step
    logits_indices: torch.Tensor | None  # None: the LM head reads every row
    draft_token_ids: torch.Tensor | None  # speculative steps only
    sampling_plan: SamplingPlan | None  # logprobs, grammars, penalties...; None: plain
    event: TransferEvent  # the flush's transfers

"""What every attention backend asks of a runner slot: the shared page table's rows and
the device views it derives from them.

Backends (MHA, MLA; V4 and V4.1 later, through the same entry point) never build a block
table: `build_metadata` takes the rows from the slot's versioned page table
(`PageTable.publish`, which queues only the step's deltas) and names the per-token view
the backend needs; `derive_views` fills that view on the device after the slot's flush
(the h2d copies and the page-table deltas have landed by then, in stream order).
"""

from __future__ import annotations

from dataclasses import dataclass

from atom.forward_context import AttentionMetadata
from atom.kernels.page_table import derive_slot_mapping, derive_slot_mapping_reference

# Speculative decoding: how the memory a verify step wrote for rejected drafts is undone.
# POSITIONS: all of it is addressed by position (paged KV, compressed entries), so moving
# num_computed_tokens back past the rejected drafts makes the next step rewrite them.
# STATE_SNAPSHOT: some of it is per-sequence state updated in place (state slots: window
# rings, compressor rows, Engram history, GDN conv and delta-rule states); the drafting
# sequences' rows are saved before the verify step, and a sequence that rejected a draft
# gets them back and recomputes from where the step began
# (atom/model_engine/speculative/state_rollback.py).
POSITIONS = "positions"
STATE_SNAPSHOT = "state_snapshot"


@dataclass(frozen=True)
class SpeculationSupport:
    """A family's declaration for speculative decoding (one per backend class; issue 31's
    AttentionFamily is meant to take it over as is)."""

    rollback: str = POSITIONS  # POSITIONS or STATE_SNAPSHOT
    # A step of several tokens per sequence (a verify step) can be captured in a CUDA
    # graph (atom/model_engine/speculative/verify_graphs.py); False: verify steps run eagerly.
    verify_graphs: bool = True


class PagedAttentionBackend:
    """Paged KV cache addressed by slot = block_id * block_size + offset (MHA, MLA)."""

    name = "paged"
    speculation = SpeculationSupport()

    def __init__(self):
        # Decode metadata holds the same views at a given padded size every step: reuse it.
        self._decode_metadata: dict[int, AttentionMetadata] = {}

    # Backends with per-step buffers of their own (V4: each row's state slot) declare them
    # here; the slot allocates them with its others and `stage` fills them in `prepare`.
    def buffer_specs(self, max_num_seqs: int, max_num_tokens: int) -> list:
        return []

    def stage(self, slot, seqs, stage) -> None:
        """Write this backend's staged buffers for `seqs` (numpy views via `stage`)."""

    def graph_metadata(self, slot, size: int) -> AttentionMetadata:
        """The metadata a decode CUDA graph of `size` rows is captured with (fixed views)."""
        return AttentionMetadata(
            slot_mapping=slot.buffers.slot_mapping[:size],
            context_lens=slot.buffers.context_lens.device[:size],
            block_tables=slot.page_table.device_rows[:size],
            cu_seqlens_q=None,
            max_seqlen_q=1,
            is_decode=True,
        )

    def verify_graph_metadata(self, slot, size: int, rows_per_seq: int) -> AttentionMetadata:
        """The metadata a multi-token CUDA graph (S = `size` sequences x `rows_per_seq`
        tokens, verify_graphs.py) is captured with: the slot's fixed views."""
        return AttentionMetadata(
            slot_mapping=slot.buffers.slot_mapping[: size * rows_per_seq],
            context_lens=slot.buffers.context_lens.device[:size],
            block_tables=slot.page_table.device_rows[:size],
            cu_seqlens_q=slot.buffers.cu_seqlens_q.device[: size + 1],
            max_seqlen_q=rows_per_seq,
            is_decode=False,
        )

    def pad_graph_rows(self, slot, start: int, end: int) -> None:
        """Make this backend's own per-row buffers well-defined padding in rows
        [start, end) of the device side (a multi-token graph replayed at a padded size)."""

    def build_metadata(self, slot, step, publish) -> AttentionMetadata:
        seqs = step.num_seqs
        padded = step.padded_seqs or seqs
        padded_tokens = step.padded_seqs or step.num_tokens
        if step.is_decode:
            context_lens = publish(slot.buffers.context_lens, seqs, padded)
            rows = slot.page_table.publish(padded)
            metadata = self._decode_metadata.get(padded)
            if metadata is None:
                metadata = self._decode_metadata[padded] = AttentionMetadata(
                    slot_mapping=slot.buffers.slot_mapping[:padded],
                    context_lens=context_lens,
                    block_tables=rows,
                    cu_seqlens_q=None,
                    max_seqlen_q=1,
                    is_decode=True,
                )
            return metadata
        return AttentionMetadata(
            slot_mapping=slot.buffers.slot_mapping[:padded_tokens],
            context_lens=publish(slot.buffers.context_lens, seqs, padded),
            block_tables=slot.page_table.publish(padded),
            cu_seqlens_q=None if step.is_decode else publish(slot.buffers.cu_seqlens_q, seqs + 1),
            max_seqlen_q=step.max_seqlen_q,
            is_decode=step.is_decode,
        )

    def derive_views(self, slot, num_tokens: int, num_rows: int, is_decode: bool) -> None:
        """slot_mapping from the page-table rows and positions, on the device.

        Decode steps replayed from a CUDA graph run this inside the graph (captured at the
        padded size; padded rows have context length 0 and get -1)."""
        derive = (
            derive_slot_mapping if slot.device.type == "cuda" else derive_slot_mapping_reference
        )
        derive(
            slot.page_table.device_rows,
            slot.buffers.positions.device,
            None if is_decode else slot.buffers.cu_seqlens_q.device,
            slot.buffers.context_lens.device,
            slot.buffers.slot_mapping,
            num_tokens,
            num_rows,
            slot.block_size,
        )


class MHABackend(PagedAttentionBackend):
    name = "mha"


class MLABackend(PagedAttentionBackend):
    """Multi-head latent attention (atom/attention/mla.py): one latent row per token and
    layer, addressed by the same slots, so the rows, the slot mapping and the metadata are
    exactly the MHA ones; only the cache layout and the kernels differ."""

    name = "mla"

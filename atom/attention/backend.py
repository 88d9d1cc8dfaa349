"""What every attention backend asks of a runner slot: the shared page table's rows and
the device views it derives from them.

Backends (MHA, MLA; V4 and V4.1 later, through the same entry point) never build a block
table: `build_metadata` takes the rows from the slot's versioned page table
(`PageTable.publish`, which queues only the step's deltas) and names the per-token view
the backend needs; `derive_views` fills that view on the device after the slot's flush
(the h2d copies and the page-table deltas have landed by then, in stream order).
"""

from __future__ import annotations

from atom.forward_context import AttentionMetadata
from atom.kernels.page_table import derive_slot_mapping, derive_slot_mapping_reference


class PagedAttentionBackend:
    """Paged KV cache addressed by slot = block_id * block_size + offset (MHA, MLA)."""

    name = "paged"

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
            slot_mapping=slot.slot_mapping[:size],
            context_lens=slot.context_lens.device[:size],
            block_tables=slot.page_table.device_rows[:size],
            cu_seqlens_q=None,
            max_seqlen_q=1,
            is_decode=True,
        )

    def build_metadata(self, slot, step, publish) -> AttentionMetadata:
        seqs = step.num_seqs
        padded = step.padded_seqs or seqs
        padded_tokens = step.padded_seqs or step.num_tokens
        if step.is_decode:
            context_lens = publish(slot.context_lens, seqs, padded)
            rows = slot.page_table.publish(padded)
            metadata = self._decode_metadata.get(padded)
            if metadata is None:
                metadata = self._decode_metadata[padded] = AttentionMetadata(
                    slot_mapping=slot.slot_mapping[:padded],
                    context_lens=context_lens,
                    block_tables=rows,
                    cu_seqlens_q=None,
                    max_seqlen_q=1,
                    is_decode=True,
                )
            return metadata
        return AttentionMetadata(
            slot_mapping=slot.slot_mapping[:padded_tokens],
            context_lens=publish(slot.context_lens, seqs, padded),
            block_tables=slot.page_table.publish(padded),
            cu_seqlens_q=None if step.is_decode else publish(slot.cu_seqlens_q, seqs + 1),
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
            slot.positions.device,
            None if is_decode else slot.cu_seqlens_q.device,
            slot.context_lens.device,
            slot.slot_mapping,
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

"""GDN (gated delta-net) backend ("gdn"): Qwen3-Next's hybrid of linear-attention layers
with a fixed-size recurrent state and full-attention layers on the shared page table.

Memory has two owners:
- per block of the shared page table: the K/V of the full-attention layers, exactly as MHA
  (atom/attention/mha.py), addressed by the rows `PageTable.publish` gives every backend.
- per sequence, a *state slot* (atom/model_engine/state_slots.py, handed out and freed with
  the sequence's KV blocks): each GDN layer's conv state (the last K - 1 inputs of its causal
  conv) and delta-rule state (``[Hv, Dk, Dv]`` fp32). Bounded by the heads, not the
  context. Preemption frees the slot; the recompute starts fresh.

Publication (atom/h2d, at the first consumer, direct and packed): each row's state slot and
whether the sequence starts this step (`fresh`: its state is taken as zero, so a reused
slot never leaks its previous owner's state). Math: atom/kernels/gdn_conv.py and
atom/kernels/gdn_delta_rule.py; decode uses static shapes only (CUDA-graph capturable).
Prefill on CUDA runs the chunked delta rule (atom/kernels/gdn_chunk.py) when a sequence's
new run reaches `Fusions.gdn_chunked_min_tokens` (atom/kernels/gdn_chunk.py `use_chunked`), the
sequential kernel otherwise; on CPU the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from atom.attention.backend import STATE_SNAPSHOT, PagedAttentionBackend, SpeculationSupport
from atom.attention.family import AttentionFamily, FamilySupport, StateTensor, layer_state
from atom.forward_context import AttentionMetadata, current_fusions, get_forward_context
from atom.h2d.slot_buffers import BufferSpec
from atom.kernels import gdn_chunk
from atom.kernels.gdn_chunk import chunk_bounds, chunked_gated_delta_rule
from atom.kernels.gdn_conv import (
    causal_conv1d_prefill,
    causal_conv1d_prefill_reference,
    causal_conv1d_update,
    causal_conv1d_update_reference,
)
from atom.kernels.gdn_delta_rule import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_reference,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_reference,
)


@dataclass
class GDNAttentionMetadata(AttentionMetadata):
    """AttentionMetadata plus each row's state slot ([num_seqs] int32, -1 = padding) and
    fresh flag ([num_seqs] int32, 1 = the sequence starts at position 0 this step); on CUDA
    prefill steps the 64-token chunks of cu_seqlens_q (atom/kernels/gdn_chunk.py
    `chunk_bounds`, derived on the device once a step for every GDN layer's kernels)."""

    state_slots: torch.Tensor | None = None
    state_fresh: torch.Tensor | None = None
    chunk_bounds: torch.Tensor | None = None


class GDNBackend(PagedAttentionBackend):
    """The paged rows and slot mapping of every backend, plus state slots and fresh flags."""

    _bounds_for: GDNAttentionMetadata | None = None  # a CUDA prefill step's, until flushed

    name = "gdn"
    # Speculative decoding: the conv and delta-rule states are updated in place, so verify
    # steps save and restore them; the varlen kernels read no host value (CUDA graphs).
    speculation = SpeculationSupport(rollback=STATE_SNAPSHOT, verify_graphs=True)

    def buffer_specs(self, max_num_seqs: int, max_num_tokens: int) -> list[BufferSpec]:
        return [
            BufferSpec("state_slots", (max_num_seqs,), torch.int32, -1),
            BufferSpec("state_fresh", (max_num_seqs,), torch.int32, 0),
        ]

    def stage(self, slot, seqs, stage) -> None:
        # Staged at capacity: a decode step publishes them padded to its graph size.
        n, family = len(seqs), slot.buffers.family
        stage(family["state_slots"], family["state_slots"].capacity)[:n] = [
            s.state_slot for s in seqs
        ]
        fresh = [s.num_computed_tokens == 0 for s in seqs]
        stage(family["state_fresh"], family["state_fresh"].capacity)[:n] = fresh

    def build_metadata(self, slot, step, publish) -> GDNAttentionMetadata:
        base = super().build_metadata(slot, step, publish)
        seqs, padded = step.num_seqs, step.padded_seqs or step.num_seqs
        metadata = GDNAttentionMetadata(
            **vars(base),
            state_slots=publish(slot.buffers.family["state_slots"], seqs, padded),
            state_fresh=publish(slot.buffers.family["state_fresh"], seqs, padded),
        )
        # CUDA prefill: the chunk bounds come from cu_seqlens once the flush has landed
        # them (packed publication copies at the flush), in `derive_views`.
        self._bounds_for = metadata if not step.is_decode and slot.device.type == "cuda" else None
        return metadata

    def derive_views(self, slot, num_tokens: int, num_rows: int, is_decode: bool) -> None:
        super().derive_views(slot, num_tokens, num_rows, is_decode)
        metadata, self._bounds_for = self._bounds_for, None
        if metadata is not None:
            metadata.chunk_bounds = chunk_bounds(metadata.cu_seqlens_q, num_tokens)

    def verify_graph_metadata(self, slot, size: int, rows_per_seq: int) -> GDNAttentionMetadata:
        # chunk_bounds None: the conv derives them inside the graph from cu_seqlens
        base = super().verify_graph_metadata(slot, size, rows_per_seq)
        return GDNAttentionMetadata(
            **vars(base),
            state_slots=slot.buffers.family["state_slots"].device[:size],
            state_fresh=slot.buffers.family["state_fresh"].device[:size],
        )

    def pad_graph_rows(self, slot, start: int, end: int) -> None:
        # padded rows touch the scratch slot
        slot.buffers.family["state_slots"].device[start:end].fill_(-1)
        slot.buffers.family["state_fresh"].device[start:end].zero_()

    def graph_metadata(self, slot, size: int) -> GDNAttentionMetadata:
        # padding at capture: touch only the scratch slot
        slot.buffers.family["state_slots"].device.fill_(-1)
        slot.buffers.family["state_fresh"].device.zero_()
        base = super().graph_metadata(slot, size)
        return GDNAttentionMetadata(
            **vars(base),
            state_slots=slot.buffers.family["state_slots"].device[:size],
            state_fresh=slot.buffers.family["state_fresh"].device[:size],
        )


class GDNFamily(AttentionFamily):
    """The full-attention layers' K/V paged exactly as MHA; per sequence each GDN layer's
    conv and delta-rule states (the model's `state_layers`, each with `state_specs`)."""

    name = "gdn"
    backend_class = GDNBackend
    # The state is not cached with the blocks; the model runs in one process.
    supports = FamilySupport(prefix_caching=False, fp8_kv=True)

    @property
    def has_state(self) -> bool:
        return True

    def state_contract(self, model, cache_dtype: torch.dtype) -> list[StateTensor]:
        return layer_state(model.state_layers, cache_dtype)


class GatedDeltaNetState(nn.Module):
    """One GDN layer's per-sequence state and the conv + delta rule over it.

    Bound through its family's state contract (GDNFamily; atom/model_engine/state_slots.py):
    ``conv_state [num_state_slots + 1, K - 1, conv_dim]`` (model dtype) and
    ``recurrent_state [num_state_slots + 1, Hv, Dk, Dv]`` (fp32)."""

    def __init__(self, num_k_heads, num_v_heads, head_k_dim, head_v_dim, kernel_size):
        super().__init__()
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = kernel_size
        self.conv_dtype = torch.get_default_dtype()  # the model dtype at construction
        self.conv_state = torch.empty(0)
        self.recurrent_state = torch.empty(0)

    def state_specs(self, cache_dtype: torch.dtype | None = None) -> dict[str, tuple]:
        """Per state slot: name -> (shape, dtype); the conv state in the model dtype, whatever
        the KV cache's (`cache_dtype` is for the families whose state follows the cache)."""
        return {
            "conv_state": ((self.kernel_size - 1, self.conv_dim), self.conv_dtype),
            "recurrent_state": (
                (self.num_v_heads, self.head_k_dim, self.head_v_dim),
                torch.float32,
            ),
        }

    def forward(self, mixed_qkv, conv_weight, g, beta) -> torch.Tensor:
        """mixed_qkv [T, conv_dim] (before the conv), conv_weight [conv_dim, K], g / beta
        [T, Hv] fp32 -> the delta rule's output [T, Hv, Dv] in mixed_qkv's dtype."""
        meta = get_forward_context().attention
        if meta.block_tables is None:  # memory profiling: one fresh sequence, no state kept
            return self._profile(mixed_qkv, conv_weight, g, beta)
        return self._run(
            mixed_qkv, conv_weight, g, beta, self.conv_state, self.recurrent_state, meta
        )

    def _run(self, mixed_qkv, conv_weight, g, beta, conv_state, recurrent_state, meta):
        """On CUDA the Triton kernels, on CPU their torch references (the same math)."""
        slots, fresh, on_gpu = meta.state_slots, meta.state_fresh, mixed_qkv.is_cuda
        if meta.is_decode:
            update = causal_conv1d_update if on_gpu else causal_conv1d_update_reference
            x = update(mixed_qkv, conv_state, conv_weight, slots, fresh)
        else:
            cu, bounds = meta.cu_seqlens_q, meta.chunk_bounds
            if on_gpu:
                x = causal_conv1d_prefill(
                    mixed_qkv, conv_state, conv_weight, cu, slots, fresh, bounds
                )
            else:
                x = causal_conv1d_prefill_reference(
                    mixed_qkv, conv_state, conv_weight, cu, slots, fresh
                )
        q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.view(-1, self.num_k_heads, self.head_k_dim)
        k = k.view(-1, self.num_k_heads, self.head_k_dim)
        v = v.view(-1, self.num_v_heads, self.head_v_dim)
        if meta.is_decode:
            rule = recurrent_gated_delta_rule if on_gpu else recurrent_gated_delta_rule_reference
            return rule(q, k, v, g, beta, recurrent_state, slots, fresh)
        args = (q, k, v, g, beta, recurrent_state, meta.cu_seqlens_q, slots, fresh)
        if not on_gpu:
            return chunk_gated_delta_rule_reference(*args)
        num_seqs = meta.cu_seqlens_q.shape[0] - 1
        min_tokens = current_fusions().gdn_chunked_min_tokens
        if gdn_chunk.use_chunked(meta.max_seqlen_q, num_seqs, min_tokens):  # where they win
            return chunked_gated_delta_rule(*args, bounds=meta.chunk_bounds)
        return chunk_gated_delta_rule(*args)  # short runs: the sequential (recurrent) kernel

    def _profile(self, mixed_qkv, conv_weight, g, beta):
        device, count = mixed_qkv.device, mixed_qkv.shape[0]
        specs = self.state_specs()
        conv_state = torch.zeros((2, *specs["conv_state"][0]), dtype=self.conv_dtype, device=device)
        recurrent = torch.zeros((2, *specs["recurrent_state"][0]), device=device)
        one = torch.ones(1, dtype=torch.int32, device=device)
        meta = GDNAttentionMetadata(
            None, None, None, torch.tensor([0, count], dtype=torch.int32, device=device),
            count, False, state_slots=one - 1, state_fresh=one,
        )  # fmt: skip
        return self._run(mixed_qkv, conv_weight, g, beta, conv_state, recurrent, meta)

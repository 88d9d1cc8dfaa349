"""The one ambient object of a forward pass: attention metadata for this step.

The ModelRunner sets it around each forward (and each CUDA-graph capture) with
`forward_context(...)`; attention layers read it with `get_forward_context()`. It is
per thread, so two engines stepping on two threads of one process (a server and an
offline reference, say) never see each other's metadata. Beside the metadata it carries
the engine's fused-kernel switches (atom/fusions.py). Nothing else is ambient.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from atom.fusions import Fusions


@dataclass
class AttentionMetadata:
    """Device-side metadata every attention backend reads.

    slot_mapping:  [num_tokens] int64, cache slot of each new token; -1 = padding (skip).
    context_lens:  [num_seqs] int32, KV length of each sequence after this step; 0 = padding.
    block_tables:  [num_seqs, max_blocks_per_seq] int32, the sequence's KV block ids.
    cu_seqlens_q:  [num_seqs + 1] int32, start of each sequence's new tokens.
    max_seqlen_q:  host int, longest run of new tokens (grid size of the prefill kernel).
    is_decode:     every sequence computes exactly one token (decode kernel, graphable).
    Dense profiling runs (no KV cache yet) leave block_tables as None.
    """

    slot_mapping: torch.Tensor | None
    context_lens: torch.Tensor | None
    block_tables: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    max_seqlen_q: int
    is_decode: bool


@dataclass
class ForwardContext:
    attention: AttentionMetadata
    # Which fused kernels the CUDA path uses (atom/fusions.py); the ModelRunner passes
    # its config's, anything else gets the defaults.
    fusions: Fusions = Fusions()
    # The CPU attention's gather plan of this step (atom/kernels/paged_attention_cpu.py):
    # built by the first layer that needs it, reused by the others (same rows, same lengths).
    cpu_attention_plan: object | None = None
    # The CPU engine's other per-step values that every layer shares, built by the first
    # layer that needs them: the rotary cos / sin rows of the step's positions, by
    # (table, positions, dtype) (atom/kernels/rotary.py `rotary_rows`), and the KV cache
    # write's (rows, slots) index (atom/kernels/kv_cache.py `kv_write_plan`).
    cpu_rotary_rows: dict = field(default_factory=dict)
    cpu_kv_write: tuple | None = None
    # The CPU runner's decode K / V rows, kept across steps (atom/kernels/decode_kv_rows.py
    # `DecodeKVRows`); None: decode attention gathers from the cache at every layer.
    cpu_decode_rows: object | None = None


_local = threading.local()


@contextmanager
def forward_context(
    attention: AttentionMetadata, fusions: Fusions | None = None, cpu_decode_rows=None
):
    previous = getattr(_local, "current", None)
    context = ForwardContext(attention, fusions or Fusions(), cpu_decode_rows=cpu_decode_rows)
    _local.current = context
    try:
        yield context
    finally:
        _local.current = previous


def current_fusions() -> Fusions:
    """The fused-kernel switches of the forward being run (the defaults outside one)."""
    current = getattr(_local, "current", None)
    return Fusions() if current is None else current.fusions


def current_forward_context() -> ForwardContext | None:
    """The context of the forward being run, None outside one."""
    return getattr(_local, "current", None)


def get_forward_context() -> ForwardContext:
    current = getattr(_local, "current", None)
    if current is None:
        raise RuntimeError("attention was called outside a forward_context(...)")
    return current

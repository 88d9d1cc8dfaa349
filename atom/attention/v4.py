"""DeepSeek-V4 attention backend ("v4"): sliding window + compressed entries + sink.

Every V4 layer attends its last `sliding_window` positions; compressed layers also attend
compressed entries: HCA (ratio 128) all of them, CSA (ratio 4, overlapping windows) the
`index_topk` the lightning indexer picks. Math and layouts: atom/kernels/v4_*.py;
the memory layout and bytes per token: docs/architecture.md ("DeepSeek-V4 memory").

Memory has two owners:
- per sequence, a *state slot* (atom/model_engine/state_slots.py, handed out and freed with
  the sequence's KV blocks): the sliding-window ring of every layer and each compressed
  layer's partial-window compressor (and indexer) rows. Bounded by the window, not the
  context.
- per block of the shared page table: the compressed entries (and CSA's indexer keys),
  `block_size // ratio` entries per block, or, when an entry spans several blocks (HCA),
  one slice of its channels per block (`pool_layout`): no block row is left empty. No
  second block table: the backend reads the rows `PageTable.publish` gives every backend.

Decode (one token per sequence) uses static shapes only (CUDA-graph capturable); prefill
(any other step: chunked, mixed) runs per sequence: the window and the compressor in torch,
then on the CUDA path (`use_cuda_path`) the indexer's top-k for the query tokens
(`indexer_topk_prefill`) and one sparse attention launch (atom/kernels/
v4_prefill_attention.py: each query's window, chosen or visible entries and sink, never a
[T, H, keys] tensor); on CPU the torch reference (dense masks, in query chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from atom.attention.backend import STATE_SNAPSHOT, PagedAttentionBackend, SpeculationSupport
from atom.attention.family import (
    AttentionFamily,
    FamilySupport,
    KVCache,
    StateTensor,
    layer_state,
)
from atom.forward_context import AttentionMetadata, get_forward_context
from atom.h2d.slot_buffers import BufferSpec
from atom.kernels.platform import use_cuda_path
from atom.kernels.v4_attention import (
    v4_decode_attention,
    v4_decode_attention_reference,
    write_window,
    write_window_reference,
)
from atom.kernels.v4_compressor import (
    compressor_decode,
    compressor_decode_reference,
    gather_entries,
    pool_entries,
    pool_layout,
    store_entries,
)
from atom.kernels.v4_indexer import (
    index_scores,
    indexer_topk_decode,
    indexer_topk_decode_reference,
    indexer_topk_prefill,
    select_topk,
)
from atom.kernels.v4_prefill_attention import (
    v4_prefill_attention,
    v4_prefill_attention_reference,
)

QUERY_CHUNK = 512  # prefill queries attended at once (memory: chunk x heads x keys)
# The CUDA path's prefill attention: "triton" (the sparse kernel and the indexer's select
# for prefill rows) or "torch" (the CPU path's dense masks in query chunks): the A/B switch
# of `benchmarks.deepseek_v4_prefill --prefill-attention triton torch` (V4 and V4.1).
PREFILL_ATTENTION = "triton"


def sparse_prefill(q: torch.Tensor) -> bool:
    """Whether a prefill attends with the Triton sparse kernel (the CUDA path, unless the
    benchmarks' A/B chose torch)."""
    return use_cuda_path(q) and PREFILL_ATTENTION == "triton"


@dataclass
class V4AttentionMetadata(AttentionMetadata):
    """AttentionMetadata plus each row's state slot ([num_seqs] int32, -1 = padding)."""

    state_slots: torch.Tensor | None = None


class V4Backend(PagedAttentionBackend):
    """The paged rows and slot mapping of every backend, plus the rows' state slots."""

    name = "v4"
    # Speculative decoding: the window rings and compressor rows (and V4.1's Engram history)
    # are written in place, so verify steps save and restore them; a multi-token step runs
    # per sequence in torch with host reads (`prefill_sequences`): never in a CUDA graph.
    speculation = SpeculationSupport(rollback=STATE_SNAPSHOT, verify_graphs=False)

    def buffer_specs(self, max_num_seqs: int, max_num_tokens: int) -> list[BufferSpec]:
        return [BufferSpec("state_slots", (max_num_seqs,), torch.int32, -1)]

    def stage(self, slot, seqs, stage) -> None:
        # Staged at capacity: a decode step publishes the rows padded to its graph size
        # (publish writes the pad value -1 into rows past the batch).
        rows = stage(
            slot.buffers.family["state_slots"], slot.buffers.family["state_slots"].capacity
        )
        rows[: len(seqs)] = [seq.state_slot for seq in seqs]

    def build_metadata(self, slot, step, publish) -> V4AttentionMetadata:
        base = super().build_metadata(slot, step, publish)
        padded = step.padded_seqs or step.num_seqs
        return V4AttentionMetadata(
            **vars(base),
            state_slots=publish(slot.buffers.family["state_slots"], step.num_seqs, padded),
        )

    def graph_metadata(self, slot, size: int) -> V4AttentionMetadata:
        # padding at capture: touch only the scratch slot
        slot.buffers.family["state_slots"].device.fill_(-1)
        base = super().graph_metadata(slot, size)
        return V4AttentionMetadata(
            **vars(base), state_slots=slot.buffers.family["state_slots"].device[:size]
        )


@dataclass
class CompressorInputs:
    """One compressed branch's projections of this step's tokens and its parameters."""

    kv: torch.Tensor  # [T, width] raw kv projection
    gate: torch.Tensor  # [T, width] raw gate projection
    position_bias: torch.Tensor  # [ratio, width] fp32
    norm_weight: torch.Tensor  # [dim] fp32
    eps: float


@dataclass
class IndexerInputs:
    compressor: CompressorInputs  # the indexer's own compressor (index_head_dim)
    q: torch.Tensor  # [T, index_heads, index_head_dim], rotated
    weights: torch.Tensor  # [T, index_heads] fp32, already scaled by index_heads^-0.5


class V4Attention(nn.Module):
    """One V4 layer's cache and attention. Bound tensors (V4Family, state_slots.py):
    ``ring`` always; with a compressor ``state_kv``/``state_gate`` and ``pool``; CSA also
    ``index_state_kv``/``index_state_gate`` and ``index_pool``."""

    def __init__(self, config, layer_type: str, rope_tables, max_model_len: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        self.scale = self.head_dim**-0.5
        self.max_model_len = max_model_len
        self.ratio = 0 if layer_type == "sliding_attention" else config.compress_rates[layer_type]
        self.overlap = layer_type == "compressed_sparse_attention"
        self.index_head_dim = config.index_head_dim if self.overlap else 0
        self.index_topk = config.index_topk
        self.compress_cos, self.compress_sin = rope_tables  # [max_position, rope_dim // 2]
        self.block_size = 0  # bound with the tensors by the KV cache allocation
        for name in ("ring", "state_kv", "state_gate", "pool"):
            setattr(self, name, torch.empty(0))
        for name in ("index_state_kv", "index_state_gate", "index_pool"):
            setattr(self, name, torch.empty(0))

    # -- layout (used by the KV cache allocation) ------------------------------------------
    def block_bytes(self, block_size: int, itemsize: int) -> int:
        return sum(r * w for r, w in self.pool_shapes(block_size).values()) * itemsize

    def pool_shapes(self, block_size: int) -> dict[str, tuple[int, int]]:
        """Per page-table block: name -> (rows, width) (`pool_layout`: an entry longer than
        a block, HCA's, is spread over its blocks, one slice of its channels in each)."""
        if not self.ratio:
            return {}
        shapes = {"pool": pool_layout(block_size, self.ratio, self.head_dim)}
        if self.overlap:
            shapes["index_pool"] = pool_layout(block_size, self.ratio, self.index_head_dim)
        return shapes

    def state_specs(self, cache_dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
        """Per state slot: name -> ((rows, width), dtype), all in the cache dtype."""
        specs = {"ring": ((self.window, self.head_dim), cache_dtype)}
        if self.ratio:
            rows = 2 * self.ratio if self.overlap else self.ratio
            width = 2 * self.head_dim if self.overlap else self.head_dim
            specs["state_kv"] = specs["state_gate"] = ((rows, width), cache_dtype)
        if self.overlap:
            index_shape = (2 * self.ratio, 2 * self.index_head_dim)
            specs["index_state_kv"] = specs["index_state_gate"] = (index_shape, cache_dtype)
        return specs

    # -- forward ---------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        sinks: torch.Tensor,
        compressor: CompressorInputs | None,
        indexer: IndexerInputs | None,
    ) -> torch.Tensor:
        """q [T, H, D] and kv [T, D] rotated -> attention output [T, H, D] (not un-rotated)."""
        meta = get_forward_context().attention
        if meta.block_tables is None:  # memory profiling: window-only, no cache
            return self._profile(q, kv, positions, sinks)
        if meta.is_decode:
            return self._decode(q, kv, positions, sinks, compressor, indexer, meta)
        return self._prefill(q, kv, positions, sinks, compressor, indexer, meta)

    def _decode(self, q, kv, positions, sinks, compressor, indexer, meta):
        slots, tables = meta.state_slots, meta.block_tables
        block_size = self.block_size
        on_gpu = use_cuda_path(q)  # Triton on CUDA, the torch references on CPU
        (write_window if on_gpu else write_window_reference)(self.ring, kv, slots, positions)
        attend = v4_decode_attention if on_gpu else v4_decode_attention_reference
        if not self.ratio:
            return attend(
                q, self.ring, slots, positions, meta.context_lens, None, None, tables, 1,
                block_size, sinks, self.scale,
            )  # fmt: skip
        self._emit_decode(compressor, self.state_kv, self.state_gate, self.pool, meta, positions)
        if indexer is not None:
            max_entries = -(-self.max_model_len // self.ratio)  # sizes the scores row only
            self._emit_decode(
                indexer.compressor, self.index_state_kv, self.index_state_gate,
                self.index_pool, meta, positions,
            )  # fmt: skip
            topk = indexer_topk_decode if on_gpu else indexer_topk_decode_reference
            entry_ids = topk(
                indexer.q, indexer.weights, self.index_pool, tables, positions,
                meta.context_lens, self.ratio, block_size, self.index_topk, max_entries,
            )  # fmt: skip
        else:  # HCA: every visible entry, counted per row from its position
            entry_ids = None
        return attend(
            q, self.ring, slots, positions, meta.context_lens, self.pool, entry_ids, tables,
            self.ratio, block_size, sinks, self.scale,
        )  # fmt: skip

    def _emit_decode(self, inputs, state_kv, state_gate, pool, meta, positions):
        emit = compressor_decode if use_cuda_path(inputs.kv) else compressor_decode_reference
        emit(
            state_kv, state_gate, inputs.kv, inputs.gate, inputs.position_bias,
            inputs.norm_weight, inputs.eps, self.compress_cos, self.compress_sin,
            meta.state_slots, positions, meta.block_tables, pool, self.ratio, self.overlap,
            self.block_size,
        )  # fmt: skip

    def _prefill(self, q, kv, positions, sinks, compressor, indexer, meta):
        """Per sequence: window over ring + new tokens, entries closed so far; attended by
        the sparse kernel (`sparse_prefill`) or in dense query chunks (torch)."""
        out = torch.zeros_like(q)
        sparse = sparse_prefill(q)
        for _row, a, b, start, end, slot, table in prefill_sequences(meta):
            window = self._window_prefill(kv[a:b], slot, start, end)
            entries = index_keys = None
            if self.ratio:
                entries = self._emit_prefill(
                    _rows(compressor, a, b), self.state_kv, self.state_gate, self.pool,
                    slot, start, end, table,
                )  # fmt: skip
                if indexer is not None:  # the sparse path's select reads the keys' pool
                    index_keys = self._emit_prefill(
                        _rows(indexer.compressor, a, b), self.index_state_kv,
                        self.index_state_gate, self.index_pool, slot, start, end, table,
                        gather=not sparse,
                    )  # fmt: skip
            if sparse:
                out[a:b] = self._attend_sparse(q[a:b], window, entries, indexer, sinks, start,
                                               a, table)  # fmt: skip
                continue
            for c in range(0, b - a, QUERY_CHUNK):  # bounded memory for long prompts
                c_end = min(c + QUERY_CHUNK, b - a)
                out[a + c : a + c_end] = self._attend_chunk(
                    q[a + c : a + c_end], window, entries, index_keys, indexer, sinks,
                    start, start + c, start + c_end, a,
                )  # fmt: skip
        return out

    def _attend_chunk(self, q, window, entries, index_keys, indexer, sinks, start, qs, qe, a):
        """Queries at positions [qs, qe) of a sequence whose step began at `start`:
        their window keys (from `window`, positions [first, end)) and visible entries
        (torch: dense scores, `select_topk`, a dense mask)."""
        keys, first = window
        chosen = None
        if index_keys is not None:
            rows = slice(a + qs - start, a + qe - start)
            ids = torch.arange(entries.shape[0], device=q.device)
            query_pos = torch.arange(qs, qe, device=q.device)
            visible = ids[None, :] < ((query_pos + 1) // self.ratio)[:, None]
            scores = index_scores(indexer.q[rows], index_keys, indexer.weights[rows])
            chosen = select_topk(scores, visible, self.index_topk)
        return v4_prefill_attention_reference(
            q, keys, first, qs, entries, chosen, self.ratio, self.window, sinks, self.scale
        )

    def _attend_sparse(self, q, window, entries, indexer, sinks, start, a, table):
        """The step's queries of one sequence (positions from `start`) in one launch of
        the sparse kernel: CSA's chosen ids from the indexer's scorer and select over the
        query tokens (their keys read from the pool), HCA every visible entry."""
        keys, first = window
        chosen = None
        if indexer is not None:
            rows = slice(a, a + q.shape[0])
            chosen = indexer_topk_prefill(
                indexer.q[rows], indexer.weights[rows], self.index_pool, table, start,
                self.ratio, self.block_size, self.index_topk,
            )  # fmt: skip
        return v4_prefill_attention(
            q, keys, first, start, entries, chosen, self.ratio, self.window, sinks, self.scale
        )

    def _window_prefill(self, kv, slot: int, start: int, end: int):
        return window_prefill(self.ring, kv, slot, start, end)

    def _emit_prefill(self, inputs, state_kv, state_gate, pool, slot, start, end, table,
                      gather: bool = True):  # fmt: skip
        """Pool the windows closing in [start, end), store them, keep the partial window's
        rows in the state; returns every entry of the sequence so far [end // ratio, dim]
        (None without ``gather``)."""
        ratio, size, device = self.ratio, state_kv.shape[1], inputs.kv.device
        dim = inputs.norm_weight.shape[-1]  # the entry width
        block_size = self.block_size
        base = max(0, (start // ratio) * ratio - (ratio if self.overlap else 0))
        held = torch.arange(base, start, device=device) % size
        kv = torch.cat([state_kv[slot, held], inputs.kv.to(state_kv.dtype)])
        gate = torch.cat([state_gate[slot, held], inputs.gate.to(state_gate.dtype)])
        keep = torch.arange(max(start, end - size), end, device=device)
        state_kv[slot, keep % size] = kv[keep - base]
        state_gate[slot, keep % size] = gate[keep - base]
        first, last = start // ratio, end // ratio
        if last > first:
            windows = torch.arange(first, last, device=device)
            offsets = windows[:, None] * ratio + torch.arange(ratio, device=device) - base
            bias = inputs.position_bias
            kv_rows = kv[offsets]
            gate_rows = gate[offsets].float() + bias
            if self.overlap:
                previous = (offsets - ratio).clamp(min=0)
                ca_gate = gate[previous][..., :dim].float() + bias[:, :dim]
                ca_gate = ca_gate.masked_fill((windows == 0)[:, None, None], float("-inf"))
                kv_rows = torch.cat([kv[previous][..., :dim], kv_rows[..., dim:]], dim=1)
                gate_rows = torch.cat([ca_gate, gate_rows[..., dim:]], dim=1)
            starts = windows * ratio
            entries = pool_entries(
                kv_rows, gate_rows, inputs.norm_weight, inputs.eps,
                self.compress_cos[starts], self.compress_sin[starts],
            )  # fmt: skip
            store_entries(pool, table, windows[None], entries[None], ratio, block_size)
        if not gather:
            return None
        ids = torch.arange(last, device=device)[None]
        return gather_entries(pool, table, ids, ratio, block_size)[0]

    def _profile(self, q, kv, positions, sinks):
        """Memory profiling run (positions 0..T-1, no cache): window attention only, in
        the prefill's query chunks, so its peak matches a real prefill's."""
        out = torch.empty_like(q)
        for c in range(0, q.shape[0], QUERY_CHUNK):
            c_end = min(c + QUERY_CHUNK, q.shape[0])
            out[c:c_end] = self._attend_chunk(
                q[c:c_end], (kv, 0), None, None, None, sinks, 0, c, c_end, 0
            )
        return out


def prefill_sequences(meta):
    """Each sequence with queries this step (host reads: the prefill path is not graphed):
    (batch row, first query row, end query row, first position, end position, state slot,
    its page-table row [1, width])."""
    cu = meta.cu_seqlens_q.tolist()
    ends = meta.context_lens[: len(cu) - 1].tolist()
    slots = meta.state_slots[: len(cu) - 1].tolist()
    for row, (end, slot) in enumerate(zip(ends, slots, strict=True)):
        a, b = cu[row], cu[row + 1]
        if b > a:
            yield row, a, b, end - (b - a), end, slot, meta.block_tables[row : row + 1]


def window_prefill(ring, kv, slot: int, start: int, end: int):
    """(keys [end - first, D] at positions [first, end), first): the ring's positions
    before `start`, then the new ones ``kv``; the ring then keeps the last `window` ones."""
    window = ring.shape[1]
    first = max(0, start - window + 1)
    past = torch.arange(first, start, device=kv.device)
    keys = torch.cat([ring[slot, past % window].to(kv.dtype), kv])
    keep = torch.arange(max(start, end - window), end, device=kv.device)
    ring[slot, keep % window] = kv[keep - start].to(ring.dtype)
    return keys, first


def _rows(inputs: CompressorInputs, a: int, b: int) -> CompressorInputs:
    return CompressorInputs(
        inputs.kv[a:b], inputs.gate[a:b], inputs.position_bias, inputs.norm_weight, inputs.eps
    )


# -- the family (atom/attention/family.py): its paged pools and per-sequence state ----------
class V4Family(AttentionFamily):
    """Per block of the page table the compressed entries (and indexer keys) of every
    compressed layer (``pool_shapes``, num_blocks + 1 rows: the last block is scratch); per
    sequence the window rings and compressor rows each layer describes (``state_specs``)."""

    name = "v4"
    backend_class = V4Backend
    supports = FamilySupport(prefix_caching=False)  # the state is not cached with blocks
    fp8_refusal = "DeepSeek-V4 (v4 backend)"

    @property
    def has_state(self) -> bool:
        return True

    def state_contract(self, model, cache_dtype: torch.dtype) -> list[StateTensor]:
        return layer_state(model.attention_layers, cache_dtype)

    def check_cache_dtype(self, cache_dtype: torch.dtype) -> None:
        if cache_dtype.itemsize < 2:
            raise ValueError(
                f"kv_cache_dtype='fp8' is not supported for {self.fp8_refusal}; use 'auto'"
            )

    def kv_block_bytes(self, model, block_size: int, cache_dtype: torch.dtype) -> int:
        """Bytes of one page-table block: the compressed entries (and indexer keys) it holds."""
        self.check_cache_dtype(cache_dtype)
        layers = model.attention_layers
        return max(1, sum(a.block_bytes(block_size, cache_dtype.itemsize) for a in layers))

    def allocate_kv_cache(self, model, num_blocks, block_size, cache_dtype, device) -> KVCache:
        self.check_cache_dtype(cache_dtype)
        pools = []
        for layer in model.attention_layers:
            layer.block_size = block_size
            for name, (rows, width) in layer.pool_shapes(block_size).items():
                pool = torch.zeros(num_blocks + 1, rows, width, dtype=cache_dtype, device=device)
                setattr(layer, name, pool)
                pools.append(pool)
        return KVCache(pools, None)

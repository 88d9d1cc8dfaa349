"""DeepSeek-V4.1 attention backend ("v41"): sliding window + shared compressed KV + sink.

Same entry point as every backend: `build_metadata` takes the rows of the slot's versioned
page table and each row's state slot (V4's buffers, V4Backend), `derive_views` fills the
slot mapping. No V4.1-only table and no V4.1-only publication path.

Per layer ``compress_ratio`` r: 0 = window only; 1 = every token is an entry; r > 1 = r
tokens softmax-pooled into one entry (non-overlapping; the partial group is state). Only the
KV-source layers own a compressor and the entries (one pool per source, paged through the
shared rows: entry w of a ratio-r source sits at block ``row[w * r // block_size]``); a later
compressed layer reads the latest source's pool. Index-source layers score the entries with
the lightning indexer against the keys of the latest source that owns keys (two-level top-k,
atom/kernels/v41_topk.py) and the layers in between reuse the published choice.

Memory (docs/architecture.md, "DeepSeek-V4.1 memory"): per sequence, in its state slot
(atom/model_engine/state_slots.py), every layer's window ring (FP8-fake-quantised K=V),
every ratio > 1 source's partial group rows (fp32 projections) and the Engram history
(the last ``max_ngram - 1`` compressed token ids, on the first layer); per page-table block,
each source's entries and (index sources) indexer keys.

Decode (one token per row) uses static shapes only (CUDA-graph capturable); any other step
runs per sequence (host reads), like the v4 backend. On CUDA the choice is Triton in both
(the two-level top-k, atom/kernels/v41_topk.py, with the query tokens as rows at prefill),
both score the key source's pool with V4's indexer kernel, and prefill attends with V4's
sparse kernel (atom/kernels/v4_prefill_attention.py: each query's window, the ids its index
source chose and the sink); on CPU the torch references (golden-exact, dense masks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from atom.attention.v4 import (
    QUERY_CHUNK,
    V4Backend,
    V4Family,
    prefill_sequences,
    sparse_prefill,
    window_prefill,
)
from atom.forward_context import get_forward_context
from atom.kernels.platform import use_cuda_path, use_triton
from atom.kernels.v4_attention import (
    attend_with_sink,
    v4_decode_attention,
    v4_decode_attention_reference,
    write_window,
    write_window_reference,
)
from atom.kernels.v4_compressor import (
    compressor_latent_decode,
    compressor_latent_decode_reference,
    gather_entries,
    pool_groups,
    pool_layout,
    store_entries,
    store_entries_decode,
    store_entries_decode_reference,
)
from atom.kernels.v4_indexer import (
    PREFILL_ROWS,
    index_scores,
    index_scores_decode,
    prefill_splits,
)
from atom.kernels.v4_prefill_attention import v4_prefill_attention
from atom.kernels.v4_topk import visible_counts
from atom.kernels.v41_topk import (
    candidate_blocks_decode,
    candidate_blocks_reference,
    two_level_topk_decode,
    two_level_topk_reference,
)


class V41Backend(V4Backend):
    """V4's buffers (rows, slot mapping, each row's state slot) under the name v41."""

    name = "v41"


class V41Family(V4Family):
    """V4's layout (entry pools per block, state rows per sequence), V4.1's layers: each
    describes its pools and state (rings, partial groups, the Engram history)."""

    name = "v41"
    backend_class = V41Backend


@dataclass
class SourceInputs:
    """A KV source's projections of this step's tokens (atom/models/deepseek_v41.py).

    ratio > 1: ``kv``/``gate`` ``[T, D]`` fp32 raw projections (pooled here, then ``finish``);
    ratio 1: ``kv`` is the normed latent already and ``gate`` is None.
    ``finish(latent, group_positions)`` -> (entries, index keys or None), both rotated and
    fake-quantised, from pre-RoPE latents ``[G, D]``."""

    kv: torch.Tensor
    gate: torch.Tensor | None
    finish: Callable


@dataclass
class IndexerInputs:
    q: torch.Tensor  # [T, index_heads, index_head_dim], rotated, fake-quantised
    weights: torch.Tensor  # [T, index_heads] fp32, scaled by index_heads^-0.5


@dataclass
class SharedChoice:
    """What one forward's index sources publish for the layers after them. Decode:
    ``topk`` [B, k] entry ids (-1 none), ``candidates`` [B, N] bool. Prefill: per row,
    ``rows[row]["topk"]`` [n, N] bool (chosen entries) and ``rows[row]["candidates"]``;
    on the sparse path (`sparse_prefill`) ``rows[row]["topk_ids"]`` [n, k] entry ids (-1
    none) and ``rows[row]["candidate_chunks"]``: first query row -> [rows, width] bool, one
    per launch of PREFILL_ROWS queries."""

    topk: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    rows: dict = field(default_factory=dict)


class V41Attention(nn.Module):
    """One V4.1 layer's cache and attention. Bound tensors (V41Family, state_slots.py):
    ``ring`` always; a source with ratio > 1 ``state_kv``/``state_gate``; a source
    ``pool`` and, owning keys, ``index_pool``; the first layer of an Engram model
    ``engram_tokens``."""

    def __init__(self, config, layer_idx: int, max_model_len: int, engram_history: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        self.scale = self.head_dim**-0.5
        self.max_model_len = max_model_len
        self.ratio = config.compress_ratios[layer_idx]
        self.is_source = self.ratio > 0 and layer_idx in config.kv_source_layer_ids
        self.is_index = self.ratio > 0 and layer_idx in config.index_source_layer_ids
        self.owns_keys = self.is_source and self.is_index
        self.index_head_dim = config.index_head_dim
        self.index_topk = config.index_topk
        self.is_candidate_source = layer_idx == config.candidate_source_layer_id
        self.uses_candidates = 0 <= config.candidate_source_layer_id < layer_idx
        self.candidate_topk_blocks = config.candidate_topk_blocks
        self.candidate_block_size = config.candidate_block_size
        self.engram_history = engram_history
        self.block_size = 0  # bound with the tensors by the KV cache allocation
        self.ring = self.state_kv = self.state_gate = torch.empty(0)
        self.pool = self.index_pool = self.engram_tokens = torch.empty(0)
        self._links = {}  # source / key source layers (set by `link`; not submodules)

    def link(self, source: V41Attention | None, key_source: V41Attention | None) -> None:
        """The KV source whose entries this layer reads, the source of its indexer keys."""
        self._links = {"source": source, "key_source": key_source}

    @property
    def source(self) -> V41Attention | None:
        return self._links.get("source")

    @property
    def key_source(self) -> V41Attention | None:
        return self._links.get("key_source")

    # -- layout (used by the KV cache allocation) ------------------------------------------
    def pool_shapes(self, block_size: int) -> dict[str, tuple[int, int]]:
        if not self.is_source:
            return {}
        shapes = {"pool": pool_layout(block_size, self.ratio, self.head_dim)}
        if self.owns_keys:
            shapes["index_pool"] = pool_layout(block_size, self.ratio, self.index_head_dim)
        return shapes

    def block_bytes(self, block_size: int, itemsize: int) -> int:
        return sum(r * w for r, w in self.pool_shapes(block_size).values()) * itemsize

    def state_specs(self, cache_dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
        """Per state slot: name -> ((rows, width), dtype)."""
        specs = {"ring": ((self.window, self.head_dim), cache_dtype)}
        if self.is_source and self.ratio > 1:
            group = ((self.ratio, self.head_dim), torch.float32)
            specs["state_kv"] = specs["state_gate"] = group
        if self.engram_history:
            specs["engram_tokens"] = ((self.engram_history, 1), torch.int64)
        return specs

    def max_entries(self) -> int:
        return -(-self.max_model_len // self.ratio)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, q, kv, positions, sinks, source, indexer, shared: SharedChoice):
        """q [T, H, D] and kv [T, D] rotated (kv fake-quantised) -> output [T, H, D]."""
        meta = get_forward_context().attention
        if meta.block_tables is None:  # memory profiling: window only, in query chunks
            out = torch.empty_like(q)
            pos = positions.long()
            for c in range(0, q.shape[0], QUERY_CHUNK):
                qp = pos[c : c + QUERY_CHUNK]
                valid = (pos[None, :] <= qp[:, None]) & (pos[None, :] > qp[:, None] - self.window)
                keys = kv[None].expand(qp.shape[0], -1, -1)
                out[c : c + QUERY_CHUNK] = attend_with_sink(
                    q[c : c + QUERY_CHUNK], keys, valid, sinks, self.scale
                )
            return out
        if meta.is_decode:
            return self._decode(q, kv, positions, sinks, source, indexer, shared, meta)
        return self._prefill(q, kv, positions, sinks, source, indexer, shared, meta)

    def _decode(self, q, kv, positions, sinks, source, indexer, shared, meta):
        """On the CUDA path (`use_cuda_path`) V4's kernels: the window write and decode
        attention, the compressor's state write and pooling (`compressor_latent_decode`)
        with one launch storing the emitted entry and key (`store_entries_decode`), the
        scores of the key source's pool and the decode selects; else the references."""
        slots, tables = meta.state_slots, meta.block_tables
        on_gpu = use_cuda_path(q)  # Triton on CUDA, the torch references on CPU
        (write_window if on_gpu else write_window_reference)(self.ring, kv, slots, positions)
        attend = v4_decode_attention if on_gpu else v4_decode_attention_reference
        if not self.ratio:
            return attend(
                q, self.ring, slots, positions, meta.context_lens, None, None, tables, 1,
                self.block_size, sinks, self.scale,
            )  # fmt: skip
        if self.is_source:
            self._emit_decode(source, slots, positions, tables, on_gpu)
        if self.is_index:
            shared.topk, candidates = self._index_decode(indexer, positions, shared, meta, on_gpu)
            if self.is_candidate_source:
                shared.candidates = candidates
        source_layer = self.source
        return attend(
            q, self.ring, slots, positions, meta.context_lens, source_layer.pool, shared.topk,
            tables, source_layer.ratio, self.block_size, sinks, self.scale,
        )  # fmt: skip

    def _index_decode(self, indexer, positions, shared, meta, on_gpu: bool):
        """(top-k entry ids [B, k], this layer's candidate blocks or None) from the key
        source's keys. CUDA path: V4's scoring kernel (which also counts each row's visible
        entries) and the decode selects; else the torch references."""
        keys_from, tables, q = self.key_source, meta.block_tables, indexer.q
        if on_gpu and keys_from.ratio == self.ratio:  # Triton reads the source's keys
            counts = torch.empty(q.shape[0], dtype=torch.int64, device=q.device)
            # the scores past a row's count are read (as -inf) only by the candidate
            # source's block maxima
            scores = index_scores_decode(
                q, indexer.weights, keys_from.index_pool, tables, positions,
                meta.context_lens, self.ratio, self.block_size, self.max_entries(),
                fill_invisible=self.is_candidate_source, counts=counts,
            )  # fmt: skip
            return self._choose_decode(scores, counts, shared.candidates)
        ids = torch.arange(self.max_entries(), device=q.device)[None]
        num_visible = (positions.long() + 1) // self.ratio
        visible = (ids < num_visible[:, None]) & (meta.context_lens > 0)[:, None]
        keys = gather_entries(keys_from.index_pool, tables, ids.expand(q.shape[0], -1),
                              keys_from.ratio, self.block_size)  # fmt: skip
        scores = index_scores(q, keys, indexer.weights)
        scores = scores.masked_fill(~visible, float("-inf"))
        if on_gpu and use_triton(scores):  # a select over each row's own entries only
            counts = visible_counts(positions, meta.context_lens, self.ratio, scores.shape[1])
            return self._choose_decode(scores, counts, shared.candidates)
        return self._choose(scores, visible, num_visible, shared.candidates)

    def _choose(self, scores, visible, num_visible, published_candidates):
        """(top-k entry ids, this layer's candidate blocks or None), by the torch references
        on CPU and CUDA alike (atom/kernels/v41_topk.py). The candidate source chooses among
        all visible entries; a later index source inside the published candidates."""
        candidates = None
        if self.is_candidate_source:
            candidates = candidate_blocks_reference(
                scores, num_visible, self.candidate_topk_blocks, self.candidate_block_size
            )
        inside = published_candidates if self.uses_candidates else None
        return two_level_topk_reference(scores, visible, self.index_topk, inside), candidates

    def _choose_decode(self, scores, counts, published_candidates):
        """`_choose` at decode on CUDA (atom/kernels/v41_topk.py's decode selects): the
        same sets, the ids in ascending order."""
        candidates = None
        if self.is_candidate_source:
            candidates = candidate_blocks_decode(
                scores, counts, self.candidate_topk_blocks, self.candidate_block_size
            )
        inside = published_candidates if self.uses_candidates else None
        return two_level_topk_decode(scores, counts, self.index_topk, inside), candidates

    def _emit_decode(self, source: SourceInputs, state_slots, positions, tables, on_gpu) -> None:
        """Write the token into the partial group; where it closes a group (every token at
        ratio 1) store the entry (and key). Padded rows touch only scratch rows. CUDA path:
        V4's compressor kernel pools the group (atom/kernels/v4_compressor.py,
        `compressor_latent_decode`) and one launch stores the entry and key."""
        ratio = self.ratio
        if ratio > 1:
            pool = compressor_latent_decode if on_gpu else compressor_latent_decode_reference
            latent = pool(
                self.state_kv, self.state_gate, source.kv, source.gate, state_slots, positions,
                source.kv.dtype,
            )  # fmt: skip
            group_positions = positions.long() // ratio * ratio
        else:
            latent, group_positions = source.kv, positions
        entries, keys = source.finish(latent, group_positions)
        store = store_entries_decode if on_gpu else store_entries_decode_reference
        index_pool = self.index_pool if keys is not None else None
        store(self.pool, tables, state_slots, positions, entries, ratio, self.block_size,
              index_pool, keys)  # fmt: skip

    def _prefill(self, q, kv, positions, sinks, source, indexer, shared, meta):
        """Per sequence: window over ring + new tokens, then the shared entries (torch,
        dense masks; on the CUDA path `_prefill_sparse`)."""
        if sparse_prefill(q):
            return self._prefill_sparse(q, kv, sinks, source, indexer, shared, meta)
        out = torch.zeros_like(q)
        for row, a, b, start, end, slot, table in prefill_sequences(meta):
            keys, first = window_prefill(self.ring, kv[a:b], slot, start, end)
            key_pos = torch.arange(first, end, device=q.device)
            query_pos = torch.arange(start, end, device=q.device)
            valid = (key_pos[None, :] <= query_pos[:, None]) & (
                key_pos[None, :] > query_pos[:, None] - self.window
            )
            keys = keys[None].expand(b - a, -1, -1)
            if self.ratio:
                if self.is_source:
                    self._emit_prefill(source, a, b, slot, start, end, table)
                source_layer = self.source
                entries = source_layer.read_entries(table, end, "pool")
                if self.is_index:
                    index_keys = self.key_source.read_entries(table, end, "index_pool")
                    num_visible = (query_pos + 1) // self.ratio
                    ids = torch.arange(index_keys.shape[0], device=q.device)
                    visible = ids[None, :] < num_visible[:, None]
                    scores = index_scores(indexer.q[a:b], index_keys, indexer.weights[a:b])
                    scores = scores.masked_fill(~visible, float("-inf"))
                    published = shared.rows.setdefault(row, {})
                    chosen, candidates = self._choose(
                        scores, visible, num_visible, published.get("candidates")
                    )
                    if self.is_candidate_source:
                        published["candidates"] = candidates
                    picked = torch.zeros(b - a, entries.shape[0] + 1, dtype=torch.bool)
                    picked = picked.to(q.device)
                    picked.scatter_(1, torch.where(chosen < 0, entries.shape[0], chosen), True)
                    published["topk"] = picked[:, :-1]
                picked = shared.rows[row]["topk"]
                keys = torch.cat([keys, entries[None].expand(b - a, -1, -1).to(keys.dtype)], 1)
                valid = torch.cat([valid, picked], dim=1)
            out[a:b] = attend_with_sink(q[a:b], keys, valid, sinks, self.scale)
        return out

    def _prefill_sparse(self, q, kv, sinks, source, indexer, shared, meta):
        """`_prefill` on the CUDA path: per sequence one launch of V4's sparse kernel over
        each query's window and the ids its index source chose (`_choose_prefill`)."""
        out = torch.zeros_like(q)
        for row, a, b, start, end, slot, table in prefill_sequences(meta):
            keys, first = window_prefill(self.ring, kv[a:b], slot, start, end)
            entries = chosen = None
            if self.ratio:
                if self.is_source:
                    self._emit_prefill(source, a, b, slot, start, end, table)
                entries = self.source.read_entries(table, end, "pool")
                published = shared.rows.setdefault(row, {})
                if self.is_index:
                    published["topk_ids"] = self._choose_prefill(
                        indexer, a, b, start, end, table, published
                    )
                chosen = published["topk_ids"]
            # ratio 1 for the kernel: the ids are always given, and their picks never pass
            # p + 1 (its bound on a query's picks), whatever the source's ratio
            out[a:b] = v4_prefill_attention(
                q[a:b], keys, first, start, entries, chosen, 1, self.window, sinks, self.scale
            )
        return out

    def _choose_prefill(self, indexer, a, b, start, end, table, published) -> torch.Tensor:
        """Ids ``[b - a, min(topk, end // ratio)]`` (ascending, -1 after) of each query of
        one sequence, the query tokens as rows of the decode selects (`_choose_decode`), in
        launches of PREFILL_ROWS queries scoring the entries the launch's last query sees
        (V4's scorer over the key source's pool when its ratio is this layer's, else torch).
        The candidate source publishes its candidate blocks per launch."""
        ratio, keys_from, device = self.ratio, self.key_source, indexer.q.device
        chosen = torch.full((b - a, min(self.index_topk, end // ratio)), -1, dtype=torch.int64,
                            device=device)  # fmt: skip
        candidate_chunks = published.setdefault("candidate_chunks", {})
        for first in range(0, b - a, PREFILL_ROWS):
            last = min(first + PREFILL_ROWS, b - a)
            rows = slice(a + first, a + last)
            positions = torch.arange(start + first, start + last, device=device)
            live = torch.ones(last - first, dtype=torch.int32, device=device)
            width = (start + last) // keys_from.ratio  # the key source's entries so far
            if width == 0:
                continue
            counts = visible_counts(positions, live, ratio, width)
            if keys_from.ratio == ratio:  # V4's scorer: -inf past each row's count
                scores = index_scores_decode(
                    indexer.q[rows], indexer.weights[rows], keys_from.index_pool,
                    table.expand(last - first, -1), positions, live, ratio, self.block_size,
                    width, num_splits=prefill_splits(last - first, device),
                )  # fmt: skip
            else:
                keys = keys_from.read_entries(table, start + last, "index_pool")
                scores = index_scores(indexer.q[rows], keys, indexer.weights[rows])
                ids = torch.arange(width, device=device)
                scores = scores.masked_fill(ids[None, :] >= counts[:, None], float("-inf"))
            if self.is_candidate_source:
                candidate_chunks[first] = candidate_blocks_decode(
                    scores, counts, self.candidate_topk_blocks, self.candidate_block_size
                )
            inside = candidate_chunks[first] if self.uses_candidates else None
            picked = two_level_topk_decode(scores, counts, self.index_topk, inside)
            k = min(picked.shape[1], chosen.shape[1])  # the picks: at most end // ratio
            chosen[first:last, :k] = picked[:, :k]
        return chosen

    def _emit_prefill(self, source: SourceInputs, a, b, slot, start, end, table) -> None:
        """Close the groups completing in [start, end) into the pool (and keys); keep the
        partial group's rows in the state."""
        ratio, device = self.ratio, source.kv.device
        first, last = start // ratio, end // ratio
        if ratio > 1:
            base = first * ratio
            held = torch.arange(base, start, device=device) % ratio
            kv = torch.cat([self.state_kv[slot, held], source.kv[a:b].float()])
            gate = torch.cat([self.state_gate[slot, held], source.gate[a:b].float()])
            tail = torch.arange(last * ratio, end, device=device)
            self.state_kv[slot, tail % ratio] = kv[tail - base]
            self.state_gate[slot, tail % ratio] = gate[tail - base]
            n = (last - first) * ratio
            latent = pool_groups(
                kv[:n].view(-1, ratio, self.head_dim),
                gate[:n].view(-1, ratio, self.head_dim),
                source.kv.dtype,
            )
        else:
            latent = source.kv[a:b]
        if last == first:
            return
        groups = torch.arange(first, last, device=device)
        entries, keys = source.finish(latent, groups * ratio)
        store_entries(self.pool, table, groups[None], entries[None], ratio, self.block_size)
        if keys is not None:
            store_entries(self.index_pool, table, groups[None], keys[None], ratio, self.block_size)

    def read_entries(self, table, end: int, name: str) -> torch.Tensor:
        """Entries (or keys) 0 .. end // ratio - 1 of one sequence from this source's pool."""
        pool = getattr(self, name)
        ids = torch.arange(end // self.ratio, device=pool.device)[None]
        return gather_entries(pool, table, ids, self.ratio, self.block_size)[0]

"""Multi-head attention (MHA / GQA) over a paged KV cache.

Cache layout per layer: k_cache, v_cache `[num_blocks, block_size, num_kv_heads, head_dim]`;
with an fp8 cache also k_scale, v_scale `[num_blocks, block_size, num_kv_heads]` (float32,
one per token and head; see atom/kernels/kv_cache.py), None otherwise.
Each step first writes the new tokens' K/V at their slots, then attends from the cache:
decode-only steps use the decode kernel (CUDA-graph safe), anything else (prefill,
chunked prefill, prefix-cache hits, mixed prefill/decode) the varlen prefill kernel.
On CUDA the Triton kernels run; on CPU a batched torch path with the same math (one SDPA
call per layer over the gathered blocks, atom/kernels/paged_attention_cpu.py; decode steps
over K / V rows the runner keeps across steps, atom/kernels/decode_kv_rows.py).

`forward_rotary` is the same with the rotary embedding folded in: on CUDA with
`Fusions.rope_kv_write` one kernel rotates q and k and writes the cache
(atom/kernels/rotary_kv.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from atom.forward_context import get_forward_context
from atom.kernels import (
    paged_decode_attention,
    paged_prefill_attention,
    store_kvcache,
    store_kvcache_reference,
)
from atom.kernels.decode_kv_rows import DecodeRowsPlan, decode_attention_rows
from atom.kernels.gemv_rope_kv import RopeKV
from atom.kernels.kv_cache import kv_write_plan, store_kvcache_cpu
from atom.kernels.paged_attention_cpu import (
    decode_attention_cpu,
    decode_plan,
    prefill_attention_cpu,
    prefill_plans,
)
from atom.kernels.rotary_kv import rotary_kv_write


class MHAAttention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, early_kv=False
    ):
        """``early_kv``: paged decode loads cached K / V before its PDL wait (a layer whose
        qkv projection is latency-bound, ``pdl.latency_bound``; paged_decode_attention)."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.early_kv = early_kv
        # Bound by the ModelRunner once the cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale: torch.Tensor | None = None  # fp8 cache only
        self.v_scale: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq * D]."""
        context = get_forward_context()
        meta = context.attention
        if meta.block_tables is None:
            return self._dense_causal(q, k, v)
        if not q.is_cuda and self.k_scale is None:  # one write plan per step, every layer
            if context.cpu_kv_write is None:
                context.cpu_kv_write = kv_write_plan(meta.slot_mapping)
            store_kvcache_cpu(k, v, self.k_cache, self.v_cache, context.cpu_kv_write)
            out = self._attend_cpu(q, meta, k, v)
            return out.reshape(q.shape[0], self.num_heads * self.head_dim)
        store = store_kvcache if q.is_cuda else store_kvcache_reference
        kv_scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        store(k, v, self.k_cache, self.v_cache, meta.slot_mapping, **kv_scales)
        return self._attend(q, meta)

    def _attend_cpu(self, q, meta, k=None, v=None) -> torch.Tensor:
        """The batched CPU path: one plan per step shared by the layers. A decode step with
        this step's k / v [B, Hkv, D] and the runner's DecodeKVRows attends over rows kept
        across steps (atom/kernels/decode_kv_rows.py), any other over a gather."""
        context = get_forward_context()
        plan = context.cpu_attention_plan
        num_slots = self.k_cache.shape[0] * self.k_cache.shape[1]
        decode_rows = context.cpu_decode_rows
        if plan is None:
            if decode_rows is not None and not meta.is_decode:
                decode_rows.invalidate()  # this step's cache writes are not in the rows
            if meta.is_decode and decode_rows is not None and self.k_scale is None:
                plan = decode_rows.plan(
                    meta.block_tables, meta.context_lens, q.shape[0], self.num_kv_heads,
                    self.k_cache.shape[1], num_slots,
                )  # fmt: skip
            if plan is None and meta.is_decode:
                plan = decode_plan(
                    meta.block_tables, meta.context_lens, q.shape[0], self.k_cache.shape[1],
                    num_slots,
                )  # fmt: skip
            elif plan is None:
                plan = prefill_plans(
                    meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                    self.k_cache.shape[1], num_slots, self.num_heads,
                )  # fmt: skip
            context.cpu_attention_plan = plan
        if isinstance(plan, DecodeRowsPlan):
            if k is None:  # no token to add: this layer's rows go stale, the next step rebuilds
                plan = plan.gather
            else:
                rows = decode_rows.layer_rows(k, v, self.k_cache, self.v_cache, plan)
                return decode_attention_rows(q, rows, plan, self.scale)
        kv_scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        if meta.is_decode:
            return decode_attention_cpu(
                q, self.k_cache, self.v_cache, plan, self.scale, **kv_scales
            )
        return prefill_attention_cpu(
            q, self.k_cache, self.v_cache, plan, meta.block_tables, meta.cu_seqlens_q,
            meta.context_lens, self.scale, **kv_scales,
        )  # fmt: skip

    def forward_rotary(self, positions, q, k, v, rotary) -> torch.Tensor:
        """`forward` of the rotated q and k: `rotary` (a RotaryEmbedding) is applied here,
        fused with the cache write on CUDA when `Fusions.rope_kv_write` is on."""
        context = get_forward_context()
        meta = context.attention
        # fp8 caches keep rotary + store: the fused kernel's e4m3 bytes did not equal the
        # store kernel's on the GPU (tests/kernels/test_rotary_kv.py, xfail there).
        fused = context.fusions.rope_kv_write and self.k_scale is None
        if not (q.is_cuda and fused and meta.block_tables is not None):
            q, k = rotary(positions, q, k)
            return self.forward(q, k, v)
        q = rotary_kv_write(
            positions, q, k, v, rotary.cos, rotary.sin, self.k_cache, self.v_cache,
            meta.slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip
        return self._attend(q, meta)

    def rope_kv(self, positions, rotary, num_heads: int):
        """The RopeKV of this step for the qkv GEMV's epilogue (Fusions.gemv_rope_kv), or None
        where it does not apply: no paged cache, an fp8 cache, more than one token (the
        caller runs it on CUDA only, tests under the interpreter)."""
        context = get_forward_context()
        meta = context.attention
        if not (
            context.fusions.gemv_rope_kv
            and positions.numel() == 1
            and meta.block_tables is not None
            and self.k_scale is None
        ):
            return None
        return RopeKV(
            positions, rotary.cos, rotary.sin, self.k_cache, self.v_cache, meta.slot_mapping,
            num_heads, self.num_kv_heads, self.head_dim,
        )  # fmt: skip

    def forward_cached(self, q: torch.Tensor) -> torch.Tensor:
        """Attention of the rotated q [T, Hq, D] over the cache, this step's K/V already
        written (by the qkv GEMV's epilogue): [T, Hq * D]."""
        context = get_forward_context()
        return self._attend(q, context.attention)

    def _attend(self, q, meta) -> torch.Tensor:
        """Attention of q over the cache (this step's K/V already written): [T, Hq * D]."""
        if not q.is_cuda:
            out = self._attend_cpu(q, meta)
            return out.reshape(q.shape[0], self.num_heads * self.head_dim)
        kv_scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        if meta.is_decode:
            out = paged_decode_attention(
                q,
                self.k_cache,
                self.v_cache,
                meta.block_tables,
                meta.context_lens,
                self.scale,
                **kv_scales,
                early_kv=self.early_kv,
            )
        else:
            out = paged_prefill_attention(
                q,
                self.k_cache,
                self.v_cache,
                meta.block_tables,
                meta.cu_seqlens_q,
                meta.context_lens,
                self.scale,
                meta.max_seqlen_q,
                **kv_scales,
            )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _dense_causal(self, q, k, v):
        """One sequence without a cache: used only by the memory-profiling run."""
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=self.scale,
        )
        return out.transpose(0, 1).reshape(q.shape[0], self.num_heads * self.head_dim)

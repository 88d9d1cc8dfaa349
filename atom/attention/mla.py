"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent cache.

Cache layout per layer: `latent_cache` `[num_blocks, block_size, kv_lora_rank + rope_dim]`,
one row per token shared by all heads: the normalised compressed KV `c` followed by the
rotated rope key `k_pe`. It is addressed by the same slots as the MHA cache (the slot
mapping `PagedAttentionBackend.derive_views` derives from the shared page table).

kv_b_proj's weight `[H * (nope + v), rank]` splits per head into W_UK `[nope, rank]` and
W_UV `[v, rank]`:
- prefill (any step that is not decode-only: chunked prefill, prefix hits, mixed steps)
  gathers each sequence's cached rows through its page-table row, decompresses them
  (k_nope, v = W_UK c, W_UV c) and runs causal attention of the new tokens over the whole
  context, in torch (the same path on CPU and CUDA);
- decode absorbs W_UK into the query (q_latent = q_nope W_UK, per head) and attends in latent
  space over the cache (`paged_mla_decode`, Triton on CUDA, CUDA-graph safe), then applies
  W_UV to the latent output. Same scores: q_nope . (W_UK c) = (q_nope W_UK) . c.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from atom.forward_context import get_forward_context
from atom.kernels.mla import (
    paged_mla_decode,
    paged_mla_decode_reference,
    store_latent_cache,
    store_latent_cache_reference,
)


class MLAAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.latent_dim = kv_lora_rank + qk_rope_head_dim  # cache row width
        self.scale = scale
        # Bound by the ModelRunner once the cache is allocated (MLAFamily, atom/attention/family.py).
        self.latent_cache = torch.empty(0)

    def forward(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        kv_b_weight: torch.Tensor,
    ) -> torch.Tensor:
        """q_nope [T, H, nope], q_rope [T, H, rope] (rotated), latent [T, rank + rope]
        (normalised c | rotated k_pe), kv_b_weight [H * (nope + v), rank] -> [T, H * v]."""
        meta = get_forward_context().attention
        num_tokens = q_nope.shape[0]
        w_kv = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        w_uk, w_uv = w_kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        if meta.block_tables is None:  # memory-profiling run: one sequence, no cache
            out = self._attend(q_nope, q_rope, latent, w_kv, 0)
            return out.reshape(num_tokens, -1)
        on_gpu = q_nope.is_cuda
        store = store_latent_cache if on_gpu else store_latent_cache_reference
        store(latent, self.latent_cache, meta.slot_mapping)
        if meta.is_decode:
            q_latent = torch.einsum("thd,hdl->thl", q_nope, w_uk)
            decode = paged_mla_decode if on_gpu else paged_mla_decode_reference
            out_latent = decode(
                q_latent,
                q_rope.contiguous(),
                self.latent_cache,
                meta.block_tables,
                meta.context_lens,
                self.scale,
            )
            out = torch.einsum("thl,hvl->thv", out_latent, w_uv)
            return out.reshape(num_tokens, self.num_heads * self.v_head_dim)
        return self._prefill(q_nope, q_rope, w_kv, meta).reshape(num_tokens, -1)

    def _prefill(self, q_nope, q_rope, w_kv, meta) -> torch.Tensor:
        """Per sequence: decompress its cached rows (prefix + new) and attend causally."""
        cu_seqlens = meta.cu_seqlens_q.tolist()  # one host read per layer (torch path)
        context_lens = meta.context_lens[: len(cu_seqlens) - 1].tolist()
        block_size = self.latent_cache.shape[1]
        flat = self.latent_cache.view(-1, self.latent_dim)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_head_dim)
        for row, context_len in enumerate(context_lens):
            start, end = cu_seqlens[row], cu_seqlens[row + 1]
            if end == start:
                continue
            num_blocks = -(-context_len // block_size)
            blocks = meta.block_tables[row, :num_blocks].long()
            offsets = torch.arange(block_size, device=blocks.device)
            slots = (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)[:context_len]
            out[start:end] = self._attend(
                q_nope[start:end], q_rope[start:end], flat[slots], w_kv, context_len - (end - start)
            )
        return out

    def _attend(self, q_nope, q_rope, rows, w_kv, prefix: int) -> torch.Tensor:
        """New tokens (after `prefix` cached ones) over rows [prefix + new, rank + rope]."""
        latent, k_rope = rows.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = torch.einsum("nl,hdl->nhd", latent, w_kv)
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        key = torch.cat(
            (k_nope, k_rope[:, None, :].expand(-1, self.num_heads, -1)), dim=-1
        ).transpose(0, 1)
        query = torch.cat((q_nope, q_rope), dim=-1).transpose(0, 1)
        num_new, num_keys = query.shape[1], key.shape[1]
        # query i sits at position prefix + i and sees keys 0 .. prefix + i
        mask = torch.ones(num_new, num_keys, dtype=torch.bool, device=query.device).tril(prefix)
        out = F.scaled_dot_product_attention(
            query, key, value.transpose(0, 1), attn_mask=mask, scale=self.scale
        )
        return out.transpose(0, 1)

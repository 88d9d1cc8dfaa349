"""Batched paged attention for the engine on CPU: one SDPA call per layer, no per-sequence
Python.

The per-sequence references (`paged_decode_attention_reference`,
`paged_prefill_attention_reference`) stay the independent oracle of tests; this is the
CPU engine's fast path with the same math (fp32 softmax over the same keys):

- a `GatherPlan` per step turns the block tables into one flat index of cache slots per
  (sequence, key position) and a key mask. Every layer of the step shares it (built once,
  kept on the forward context), so a layer costs one index of K, one of V and one
  `scaled_dot_product_attention`;
- masked key positions read the sequence's first slot instead of the garbage past its
  end (the cache is `torch.empty`: a NaN there times a zero probability would still be
  NaN), so no pass over the gathered values is needed;
- GQA without copies: a KV head's query group is SDPA's query axis (decode) or part of it
  (prefill), so K / V are never repeated per query head.

Sequences are padded to the longest of the step. Prefill groups consecutive sequences so a
group's padded queries x keys stay under `MAX_PADDED_SCORES` (per query head); a sequence
above it alone takes the chunked per-sequence reference (its own compute dwarfs the Python).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from atom.kernels.decode_attention import paged_decode_attention_reference
from atom.kernels.kv_cache import dequantize_fp8_reference, is_quantized
from atom.kernels.prefill_attention import paged_prefill_attention_reference

MAX_PADDED_SCORES = 1 << 22  # padded queries x keys of one prefill group


@dataclass
class GatherPlan:
    """Where one group of sequences reads its keys, shared by every layer of a step.

    slots:       [B, T] int64 cache slot of each key position (masked ones: a valid slot).
    mask:        [B, 1, Q, T] bool, True where the query may attend the key; None where
                 every query attends every key (a decode step whose sequences all have
                 the same length: SDPA without a mask is a third faster).
    query_index: [B * Q] int64 row of q for each padded query (prefill; None for decode).
    token_index: [n] int64 padded row of each real query (prefill) ...
    token_rows:  [n] int64 ... and its row of q / of the output.
    live:        [B, 1, 1, 1] bool, False for a padding row (context length 0): zeros out;
                 None when every row is live.
    """

    slots: torch.Tensor
    mask: torch.Tensor | None
    query_index: torch.Tensor | None = None
    token_index: torch.Tensor | None = None
    token_rows: torch.Tensor | None = None
    live: torch.Tensor | None = None


def _key_slots(block_tables, lens, num_keys: int, block_size: int, num_slots: int):
    """[B, T] slots of the first `num_keys` positions and the [B, T] validity mask."""
    num_blocks = -(-num_keys // block_size)
    offsets = torch.arange(block_size, device=lens.device)
    blocks = block_tables[:, :num_blocks].long()
    slots = (blocks[:, :, None] * block_size + offsets).flatten(1)[:, :num_keys]
    valid = torch.arange(num_keys, device=lens.device)[None, :] < lens[:, None]
    slots = torch.where(valid, slots, slots[:, :1]).clamp_(0, num_slots - 1)
    return slots, valid


def decode_plan(block_tables, context_lens, batch: int, block_size: int, num_slots: int):
    lens = context_lens[:batch].long()
    num_keys = max(1, int(lens.max()))
    slots, valid = _key_slots(block_tables[:batch], lens, num_keys, block_size, num_slots)
    live = lens > 0
    if bool(live.all()):
        if bool(lens.min() == num_keys):  # all of one length: no key to mask
            return GatherPlan(slots, None)
        return GatherPlan(slots, valid[:, None, None, :])
    valid[:, 0] |= ~live  # a padding row attends one (finite) key, then is zeroed
    return GatherPlan(slots, valid[:, None, None, :], live=live[:, None, None, None])


def prefill_plans(block_tables, cu_seqlens_q, context_lens, block_size, num_slots, heads):
    """One plan per group of consecutive sequences, or an int b for a sequence that runs
    alone through the per-sequence reference."""
    cu = cu_seqlens_q.tolist()
    lens = context_lens[: len(cu) - 1].tolist()
    plans, group = [], []

    def flush():
        if group:
            plans.append(_prefill_group(block_tables, cu, lens, group, block_size, num_slots))
            group.clear()

    for b, context_len in enumerate(lens):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0 or context_len == 0:
            continue
        if q_len * context_len * heads > MAX_PADDED_SCORES:
            flush()
            plans.append(b)
            continue
        members = group + [b]
        max_q = max(cu[m + 1] - cu[m] for m in members)
        max_k = max(lens[m] for m in members)
        if len(members) * max_q * max_k * heads > MAX_PADDED_SCORES:
            flush()
        group.append(b)
    flush()
    return plans


def _prefill_group(block_tables, cu, lens, members, block_size, num_slots):
    device = block_tables.device
    starts = torch.tensor([cu[b] for b in members], device=device)
    q_lens = torch.tensor([cu[b + 1] - cu[b] for b in members], device=device)
    k_lens = torch.tensor([lens[b] for b in members], device=device)
    max_q, max_k = int(q_lens.max()), int(k_lens.max())
    rows = torch.tensor(members, device=device)
    slots, valid_k = _key_slots(block_tables[rows], k_lens, max_k, block_size, num_slots)
    q_pos = torch.arange(max_q, device=device)
    valid_q = q_pos[None, :] < q_lens[:, None]  # [G, Q]
    # causal: query i of a sequence sits at position prefix + i
    key_pos = torch.arange(max_k, device=device)
    causal = key_pos[None, None, :] <= (k_lens - q_lens)[:, None, None] + q_pos[None, :, None]
    mask = causal & valid_k[:, None, :]
    mask[:, :, 0] |= ~valid_q  # padded queries attend one key, their rows are dropped
    rows_q = starts[:, None] + q_pos
    query_index = torch.where(valid_q, rows_q, starts[:, None]).flatten()
    padded = torch.arange(len(members), device=device)[:, None] * max_q + q_pos
    return GatherPlan(slots, mask[:, None], query_index, padded[valid_q], rows_q[valid_q])


def _gather(cache, scales, slots) -> torch.Tensor:
    """[B, T, kv_heads, dim] fp32 rows of `slots` [B, T]. index_select of a flat index:
    about 4x faster than advanced indexing with the 2-D one on this CPU."""
    flat, index = cache.flatten(0, 1), slots.flatten()
    shape = (*slots.shape, *cache.shape[2:])
    if not is_quantized(cache):
        return flat.index_select(0, index).view(shape).float()
    rows = flat.view(torch.uint8).index_select(0, index).view(cache.dtype).view(shape)
    return dequantize_fp8_reference(
        rows, scales.flatten(0, 1).index_select(0, index).view(shape[:-1])
    )


def decode_attention_cpu(q, k_cache, v_cache, plan: GatherPlan, scale, *, k_scale, v_scale):
    """q [B, Hq, D] -> [B, Hq, D] in q's dtype (fp32 math)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    # [B, Hkv, T, D]; the query group of a KV head is SDPA's query axis
    k = _gather(k_cache, k_scale, plan.slots).transpose(1, 2)
    v = _gather(v_cache, v_scale, plan.slots).transpose(1, 2)
    query = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim).float()
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=plan.mask, scale=scale)
    if plan.live is not None:
        out = out.where(plan.live, 0.0)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def prefill_attention_cpu(
    q, k_cache, v_cache, plans, block_tables, cu_seqlens_q, context_lens, scale, *,
    k_scale, v_scale,
):  # fmt: skip
    """q [tokens, Hq, D] -> [tokens, Hq, D] in q's dtype (fp32 math); rows of sequences
    with no query or no context stay zero, like the reference."""
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_q_heads // num_kv_heads
    result = torch.zeros(tokens, num_q_heads, head_dim, dtype=torch.float32)
    for plan in plans:
        if isinstance(plan, int):  # one long sequence: the chunked reference
            b, cu = plan, cu_seqlens_q
            rows = slice(int(cu[b]), int(cu[b + 1]))
            result[rows] = paged_prefill_attention_reference(
                q[rows], k_cache, v_cache, block_tables[b : b + 1],
                torch.tensor([0, rows.stop - rows.start], dtype=torch.int32),
                context_lens[b : b + 1], scale, k_scale=k_scale, v_scale=v_scale,
            ).float()  # fmt: skip
            continue
        batch, max_q = plan.slots.shape[0], plan.mask.shape[2]
        k = _gather(k_cache, k_scale, plan.slots).transpose(1, 2)  # [G, Hkv, T, D]
        v = _gather(v_cache, v_scale, plan.slots).transpose(1, 2)
        query = q[plan.query_index].float().view(batch, max_q, num_kv_heads, group_size, head_dim)
        # [G, Hkv, group * Q, D]: query heads of a KV head stacked along the query axis
        query = query.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, -1, head_dim)
        num_keys = plan.mask.shape[3]
        mask = plan.mask.expand(batch, group_size, max_q, num_keys).reshape(batch, 1, -1, num_keys)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)
        out = out.view(batch, num_kv_heads, group_size, max_q, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(batch * max_q, num_q_heads, head_dim)
        result[plan.token_rows] = out[plan.token_index]
    return result.to(q.dtype)


__all__ = [
    "GatherPlan",
    "decode_attention_cpu",
    "decode_plan",
    "paged_decode_attention_reference",
    "prefill_attention_cpu",
    "prefill_plans",
]

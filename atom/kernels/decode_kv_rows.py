"""CPU decode attention over K / V rows kept across steps: no gather per layer and step.

`decode_attention_cpu` (atom/kernels/paged_attention_cpu.py) copies every sequence's keys
and values out of the paged cache at every layer of every step; at batch 64 and ~160 keys
that copy was ~40% of decode attention (docs/benchmarks.md, CPU section). A decode step
only adds one token per sequence, so `DecodeKVRows` keeps each layer's copy from the
previous step, `[2, B, kv_heads, capacity, dim]` (K and V, one padded row per sequence and
head), and a step copies its new token from the cache into it (one `index_select` and
one `index_copy_` per cache: the rows hold the cache's own bytes) before SDPA
reads it in place (head-major: SDPA's flash kernel is 11-27% faster on it than on the
cache's token-major rows at batch 64, 160 keys, the same bytes out). The rows are rebuilt
from the cache (one index_select per cache, like the gather) whenever the step is not the
previous one plus a token per sequence: another batch or row order, another block table, a
row past `capacity`, a step after any forward that was not a decode step.

The rows hold the cache's own bytes and SDPA sees the keys of the gather path (masked
positions hold other finite values, weighted by exactly 0), so the output is the same bytes
as `decode_attention_cpu`'s (tests/kernels/test_decode_kv_rows.py).

Owner: one `DecodeKVRows` per ModelRunner (CPU), passed to the layers in the forward
context; it holds one buffer per layer, keyed by the layer's K cache, until a rebuild of
another shape replaces it. Memory: at most the cache's own size again (`capacity` x batch
never above the cache's slots); a step over it takes the gather path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from atom.kernels.paged_attention_cpu import GatherPlan, decode_plan

# Rows are rebuilt with room for this many more tokens (rounded up to it): one gather per
# ROW_HEADROOM decode steps instead of one per step.
ROW_HEADROOM = 32


@dataclass
class DecodeRowsPlan:
    """What every layer of one decode step does with its rows.

    gather:        the step's GatherPlan (key mask; the fallback of a layer whose rows are
                   missing or stale);
    step:          DecodeKVRows' step count at this step;
    extend:        the previous step's rows are these rows minus this step's token;
    capacity:      keys per row of the buffers;
    write_index:   [B * kv_heads] int64 position (b * kv_heads + h) * capacity +
                   context_len - 1 of this step's token in a buffer's flat K (or V) rows;
    token_index:   [B * kv_heads] int64 row of the cache viewed as [slots * kv_heads, dim]
                   holding this step's token (b, h): what an extend copies into the rows,
                   read back from the cache so the rows hold the cache's own bytes;
    rebuild_index: [B * kv_heads * capacity] int64 row of the cache viewed as
                   [slots * kv_heads, dim] for each position of the flat rows (built by the
                   first layer that rebuilds).
    """

    gather: GatherPlan
    step: int
    extend: bool
    capacity: int
    write_index: torch.Tensor
    token_index: torch.Tensor
    rebuild_index: torch.Tensor | None = None


def _rebuild_index(slots, num_kv_heads: int, capacity: int) -> torch.Tensor:
    """`DecodeRowsPlan.rebuild_index` of the gather plan's [B, T] slots: positions past T
    read the row's first slot (finite; weighted by 0 once the rows grow over them)."""
    batch, num_keys = slots.shape
    slots = torch.cat((slots, slots[:, :1].expand(batch, capacity - num_keys)), dim=1)
    heads = torch.arange(num_kv_heads)
    return (slots[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()


class DecodeKVRows:
    """The per-layer K / V rows of the running decode batch, kept across steps."""

    def __init__(self):
        self.step = 0
        # The last decode step's rows: block tables [B, blocks] and context lengths [B]
        # (None: the next decode step rebuilds).
        self.block_tables: torch.Tensor | None = None
        self.context_lens: torch.Tensor | None = None
        self.capacity = 0
        # K cache data_ptr -> (step of the last write, [2, B, kv_heads, capacity, dim])
        self.buffers: dict[int, tuple[int, torch.Tensor]] = {}

    def invalidate(self) -> None:
        """A forward that is not a decode step: the next decode step rebuilds (its cache
        writes are not in the rows)."""
        self.block_tables = self.context_lens = None

    def release(self) -> None:
        self.invalidate()
        self.buffers.clear()

    def plan(self, block_tables, context_lens, batch, num_kv_heads, block_size, num_slots):
        """The DecodeRowsPlan of a decode step, or None where the rows do not apply (a
        padding row, or rows over the cache's size): the step takes the gather path."""
        self.step += 1
        lens = context_lens[:batch].long()
        num_keys = int(lens.max())
        capacity = -(-(num_keys + ROW_HEADROOM) // ROW_HEADROOM) * ROW_HEADROOM
        capacity = min(capacity, num_slots // batch)
        if bool((lens <= 0).any()) or capacity < num_keys:
            self.release()
            return None
        gather = decode_plan(block_tables, context_lens, batch, block_size, num_slots)
        num_blocks = -(-num_keys // block_size)
        tables = block_tables[:batch, :num_blocks]
        previous = self.context_lens
        extend = (
            previous is not None
            and previous.shape[0] == batch
            and num_keys <= self.capacity
            and torch.equal(lens, previous + 1)
            and torch.equal(tables[:, : self.block_tables.shape[1]], self.block_tables)
        )
        if not extend:
            self.capacity = capacity
        self.block_tables, self.context_lens = tables.clone(), lens.clone()
        heads = torch.arange(batch * num_kv_heads).view(batch, num_kv_heads)
        write_index = (heads * self.capacity + lens[:, None] - 1).flatten()
        last_slots = gather.slots[torch.arange(batch), lens - 1]  # this step's token
        token_index = (last_slots[:, None] * num_kv_heads + torch.arange(num_kv_heads)).flatten()
        return DecodeRowsPlan(gather, self.step, extend, self.capacity, write_index, token_index)

    def layer_rows(self, k, v, k_cache, v_cache, plan: DecodeRowsPlan) -> torch.Tensor:
        """This layer's [2, B, kv_heads, capacity, dim] rows with this step's token: the
        previous step's plus the token the cache now holds (k / v [B, kv_heads, dim] give
        the shape; the bytes are read back from the cache, whatever the store wrote), or
        rebuilt from the cache."""
        key = k_cache.data_ptr()
        batch, num_kv_heads, head_dim = k.shape
        shape = (2, batch, num_kv_heads, plan.capacity, head_dim)
        last_step, rows = self.buffers.get(key, (None, None))
        if plan.extend and last_step == plan.step - 1 and rows.shape == shape:
            flat = rows.view(2, -1, head_dim)
            for index, cache in enumerate((k_cache, v_cache)):
                token = cache.view(-1, head_dim).index_select(0, plan.token_index)
                flat[index].index_copy_(0, plan.write_index, token)
        else:
            if rows is None or rows.shape != shape:
                rows = None  # free the old rows before taking the new ones
                self.buffers.pop(key, None)
                rows = torch.empty(shape, dtype=k_cache.dtype)
            if plan.rebuild_index is None:  # once per step, for every layer that rebuilds
                plan.rebuild_index = _rebuild_index(plan.gather.slots, num_kv_heads, plan.capacity)
            for index, cache in enumerate((k_cache, v_cache)):  # straight into head-major
                flat_cache = cache.view(-1, head_dim)
                torch.index_select(
                    flat_cache, 0, plan.rebuild_index, out=rows[index].view(-1, head_dim)
                )
        self.buffers[key] = (plan.step, rows)
        return rows


def decode_attention_rows(q, rows: torch.Tensor, plan: DecodeRowsPlan, scale) -> torch.Tensor:
    """q [B, Hq, D] over `layer_rows`' rows -> [B, Hq, D] in q's dtype (fp32 math), the
    same bytes as `decode_attention_cpu` over the cache."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = rows.shape[2]
    num_keys = plan.gather.slots.shape[1]
    # [B, Hkv, T, D] views; the query group of a KV head is SDPA's query axis
    k = rows[0, :, :, :num_keys].float()
    v = rows[1, :, :, :num_keys].float()
    query = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim).float()
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=plan.gather.mask, scale=scale)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


__all__ = ["DecodeKVRows", "DecodeRowsPlan", "ROW_HEADROOM", "decode_attention_rows"]

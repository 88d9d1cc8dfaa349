"""CPU decode attention over K / V rows kept across steps (atom/kernels/decode_kv_rows.py)
against the gather path (the same bytes) and the per-sequence reference, over runs of
decode steps: rows extended a token a step, rebuilt when the batch, its block tables or a
row's capacity change, after a forward that was not a decode step, and for a layer whose
rows went stale; the gather path where a padding row or the cache's size rules rows out."""

import pytest
import torch

from atom.kernels import paged_decode_attention_reference
from atom.kernels.decode_kv_rows import ROW_HEADROOM, DecodeKVRows, decode_attention_rows
from atom.kernels.paged_attention_cpu import decode_attention_cpu, decode_plan
from tests.kernels.paged_kv import make_paged_kv
from tests.kernels.test_paged_attention_cpu import poison_unowned


class Layers:
    """Two layers' paged caches holding every sequence's keys up to `final_lens` (a step
    at lengths `lens` reads the first lens of them), NaN in every slot nobody owns."""

    def __init__(self, final_lens, num_kv_heads=3, head_dim=64, block_size=16, spare_blocks=64):
        self.block_size = block_size
        k_cache, v_cache, block_tables, keys, values = make_paged_kv(
            final_lens, num_kv_heads, head_dim, block_size, torch.float32, "cpu",
            capacity=len(final_lens), spare_blocks=spare_blocks,
        )  # fmt: skip
        for cache in (k_cache, v_cache):
            poison_unowned(cache, block_tables, final_lens, block_size)
        # layer 1: other values in the same blocks (a step shares its block tables)
        self.caches = [(k_cache, v_cache), (v_cache * 0.5, k_cache - 1)]
        self.keys = [keys, [v * 0.5 for v in values]]
        self.values = [values, [k - 1 for k in keys]]
        self.block_tables = block_tables
        self.num_slots = k_cache.shape[0] * block_size

    def step(self, rows, lens, q, layers=(0, 1), rows_of=None, reference=False):
        """One decode step at `lens` over `rows_of` (sequence of each batch row; default
        all in order): each layer's output checked against the gather path, and against the
        per-sequence reference at a rebuild or with `reference`. Returns the step's plan."""
        rows_of = list(range(len(lens))) if rows_of is None else rows_of
        lens_t = torch.tensor(lens, dtype=torch.int32)
        batch, scale = len(lens), q.shape[-1] ** -0.5
        plan = None
        for layer in layers:
            k_cache, v_cache = self.caches[layer]
            tables = self.block_tables[rows_of]
            if plan is None:
                plan = rows.plan(tables, lens_t, batch, 3, self.block_size, self.num_slots)
            newest = list(zip(rows_of, lens, strict=True))  # (sequence, length) of each row
            k_new = torch.stack([self.keys[layer][s][n - 1] for s, n in newest])
            v_new = torch.stack([self.values[layer][s][n - 1] for s, n in newest])
            gather = decode_plan(tables, lens_t, batch, self.block_size, self.num_slots)
            expected = decode_attention_cpu(
                q, k_cache, v_cache, gather, scale, k_scale=None, v_scale=None
            )
            if plan is None:  # rows ruled out: the gather path
                continue
            kv_rows = rows.layer_rows(k_new, v_new, k_cache, v_cache, plan)
            out = decode_attention_rows(q, kv_rows, plan, scale)
            assert torch.equal(out, expected)
            if not plan.extend or reference:
                expected = paged_decode_attention_reference(
                    q, k_cache, v_cache, tables, lens_t, scale
                )
                torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        return plan


def query(batch, seed=0):
    return torch.randn(batch, 9, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("start", [[300, 129, 16, 15, 17], [145, 145, 145], [1, 40]])
def test_rows_extend_then_rebuild_past_capacity(start):
    steps = 2 * ROW_HEADROOM + 1  # past the first capacity (at most 2x the headroom), once
    layers = Layers([n + steps for n in start])
    rows = DecodeKVRows()
    rebuilds = 0
    for step in range(steps):
        lens = [n + step for n in start]
        plan = layers.step(rows, lens, query(len(lens), step), reference=step == steps - 1)
        rebuilds += not plan.extend
    assert rebuilds == 2  # the first step, then once past the headroom


def test_rows_rebuild_on_another_batch_table_or_forward():
    start = [40, 33, 17]
    layers = Layers([n + 8 for n in start])
    rows = DecodeKVRows()
    q = query(3)
    assert not layers.step(rows, start, q).extend
    assert layers.step(rows, [n + 1 for n in start], q).extend
    # another order of the same sequences: other block tables, rebuilt
    lens = [n + 2 for n in start]
    order = [2, 0, 1]
    plan = layers.step(rows, [lens[i] for i in order], q, rows_of=order)
    assert not plan.extend
    plan = layers.step(rows, [lens[i] + 1 for i in order], q, rows_of=order)
    assert plan.extend
    # fewer sequences: rebuilt
    assert not layers.step(rows, [lens[2] + 2, lens[0] + 2], query(2), rows_of=[2, 0]).extend
    # a forward that was not a decode step in between: rebuilt
    rows.invalidate()
    assert not layers.step(rows, [lens[2] + 3, lens[0] + 3], query(2), rows_of=[2, 0]).extend


def test_rows_rebuild_where_a_length_did_not_grow_by_one():
    layers = Layers([50, 50])
    rows = DecodeKVRows()
    q = query(2)
    layers.step(rows, [20, 30], q)
    assert not layers.step(rows, [21, 33], q).extend  # a speculative catch-up, say
    assert layers.step(rows, [22, 34], q).extend


def test_stale_layer_rebuilds_alone():
    """A layer that skipped a step (no k / v to add) rebuilds at the next one; the others
    extend."""
    layers = Layers([60, 44])
    rows = DecodeKVRows()
    q = query(2)
    layers.step(rows, [30, 20], q)
    layers.step(rows, [31, 21], q, layers=(0,))  # layer 1 skipped this step
    plan = layers.step(rows, [32, 22], q)  # layer 1's rows are a step old: rebuilt, same output
    assert plan.extend


def test_padding_row_or_cache_size_takes_the_gather_path():
    layers = Layers([40, 40])
    rows = DecodeKVRows()
    q = query(2)
    assert layers.step(rows, [30, 0], q) is None
    # rows of both sequences would not fit in a cache of this many slots
    lens = torch.tensor([30, 31], dtype=torch.int32)
    assert rows.plan(layers.block_tables, lens, 2, 3, 16, 2 * 30) is None
    # capacity shrinks to what fits, above the longest row
    plan = rows.plan(layers.block_tables, lens, 2, 3, 16, 2 * 40)
    assert plan.capacity == 40

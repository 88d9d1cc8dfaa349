"""DeepSeek-V4 torch references (atom/kernels/v4_*.py) against hand-written loops.

The tie-break of the indexer's top-k (lower entry id first) is tested directly; the
decode-step compressor (state update + entry emission into the paged pool) against a
per-window loop over the whole sequence, for lengths 1, non-multiples of every ratio and
long contexts; the decode attention against a per-query softmax with the sink.
"""

import math

import pytest
import torch

from atom.kernels.v4_attention import v4_decode_attention_reference, write_window_reference
from atom.kernels.v4_compressor import (
    compressor_decode_reference,
    gather_entries,
    pool_layout,
)
from atom.kernels.v4_indexer import select_topk
from atom.kernels.v4_rope import apply_interleaved_rope_reference, rope_tables


def test_topk_ties_pick_the_lower_entry_first():
    scores = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0, 1.0]])
    visible = torch.ones_like(scores, dtype=torch.bool)
    assert select_topk(scores, visible, 3).tolist() == [[1, 3, 5]]
    assert select_topk(scores, visible, 4).tolist() == [[1, 3, 5, 0]]
    zeros = torch.zeros(1, 6)  # every head negative: ReLU gives exact zeros everywhere
    assert select_topk(zeros, visible, 3).tolist() == [[0, 1, 2]]
    # invisible entries are never picked; fewer visible than k -> -1
    visible = torch.tensor([[True, False, True, False, False, False]])
    assert select_topk(scores, visible, 3).tolist() == [[0, 2, -1]]


def _hand_entry(kv, gate, bias, weight, eps, cos, sin, w, ratio, overlap, dim):
    """Entry w from the full sequence's projections, one window at a time."""
    rows_kv, rows_gate = [], []
    if overlap:
        for p in range((w - 1) * ratio, w * ratio):
            rows_kv.append(kv[p, :dim] if p >= 0 else torch.zeros(dim))
            rows_gate.append(gate[p, :dim] + bias[p % ratio, :dim] if p >= 0 else
                             torch.full((dim,), -math.inf))  # fmt: skip
    for p in range(w * ratio, (w + 1) * ratio):
        half = slice(dim, 2 * dim) if overlap else slice(0, dim)
        rows_kv.append(kv[p, half])
        rows_gate.append(gate[p, half] + bias[p % ratio, half])
    weights = torch.stack(rows_gate).softmax(dim=0)
    pooled = (torch.stack(rows_kv) * weights).sum(dim=0)
    normed = weight * pooled * torch.rsqrt(pooled.pow(2).mean() + eps)
    start = w * ratio
    return apply_interleaved_rope_reference(normed[None, None], cos[start : start + 1],
                                            sin[start : start + 1])[0, 0]  # fmt: skip


@pytest.mark.parametrize("overlap,ratio,length", [(True, 4, 1), (True, 4, 23), (False, 8, 37),
                                                  (False, 32, 200), (True, 4, 301)])  # fmt: skip
def test_compressor_decode_matches_per_window_loop(overlap, ratio, length):
    torch.manual_seed(ratio + length)
    dim, rope_dim, block_size, eps = 16, 8, 16, 1e-6
    width = 2 * dim if overlap else dim
    kv, gate = torch.randn(length, width), torch.randn(length, width)
    bias, weight = torch.randn(ratio, width), torch.rand(dim) + 0.5
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2).float() / rope_dim))
    cos, sin = rope_tables(inv_freq, 512)
    num_blocks = -(-length // block_size) + 2
    table = torch.randperm(num_blocks)[None].int()  # one sequence, shuffled blocks
    rows = 2 * ratio if overlap else ratio
    state_kv, state_gate = torch.zeros(3, rows, width), torch.zeros(3, rows, width)
    pool = torch.zeros(num_blocks + 1, *pool_layout(block_size, ratio, dim))
    slots = torch.tensor([1, -1])  # row 1 is padding: it must touch only the scratch slot
    for t in range(length):
        compressor_decode_reference(
            state_kv, state_gate, torch.stack([kv[t], kv[t]]), torch.stack([gate[t], gate[t]]),
            bias, weight, eps, cos, sin, slots, torch.tensor([t, 0]),
            torch.cat([table, table]), pool, ratio, overlap, block_size,
        )  # fmt: skip
    assert state_kv[0].abs().sum() == 0 and state_gate[0].abs().sum() == 0
    for w in range(length // ratio):
        expected = _hand_entry(kv, gate, bias, weight, eps, cos, sin, w, ratio, overlap, dim)
        got = gather_entries(pool, table, torch.tensor([[w]]), ratio, block_size)[0, 0]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,position", [(4, 0), (5, 3), (8, 100), (16, 1000)])
def test_decode_attention_matches_per_query_softmax(window, position):
    torch.manual_seed(window + position)
    heads, dim, ratio, block_size = 4, 16, 4, 16
    num_entries = (position + 1) // ratio
    num_blocks = -(-(position + 1) // block_size) + 1
    ring = torch.zeros(3, window, dim)
    history = torch.randn(position + 1, dim)
    for p in range(position + 1):
        write_window_reference(ring, history[p : p + 1], torch.tensor([0]), torch.tensor([p]))
    pool = torch.randn(num_blocks + 1, block_size // ratio, dim)
    table = torch.randperm(num_blocks)[None].int()
    ids = torch.tensor([[e for e in (0, num_entries // 2, num_entries - 1) if e >= 0] + [-1]])
    ids = torch.unique_consecutive(ids, dim=1) if num_entries else torch.tensor([[-1]])
    q, sinks, scale = torch.randn(1, heads, dim), torch.randn(heads), dim**-0.5
    out = v4_decode_attention_reference(
        q, ring, torch.tensor([0]), torch.tensor([position]), torch.tensor([position + 1]),
        pool, ids, table, ratio, block_size, sinks, scale,
    )  # fmt: skip
    keys = [history[p] for p in range(max(0, position - window + 1), position + 1)]
    entries = gather_entries(pool, table, ids.clamp(min=0), ratio, block_size)[0]
    keys += [e for e, i in zip(entries, ids[0], strict=True) if i >= 0]
    keys = torch.stack(keys)
    for h in range(heads):
        logits = torch.cat([keys @ q[0, h] * scale, sinks[h : h + 1]])
        probs = logits.softmax(dim=0)[:-1]
        torch.testing.assert_close(out[0, h], probs @ keys, rtol=1e-5, atol=1e-5)

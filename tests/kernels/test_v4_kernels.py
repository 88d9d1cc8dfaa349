"""DeepSeek-V4 Triton kernels against their torch references (CPU interpreter; `gpu`
variants on CUDA): window write and the one-pass decode attention (window + selected
compressed entries + sink), lengths 1, non-multiples of every window and long contexts,
with padded rows (state slot -1, context length 0)."""

import pytest
import torch

from atom.kernels.v4_attention import (
    v4_decode_attention,
    v4_decode_attention_reference,
    write_window,
    write_window_reference,
)
from atom.kernels.v4_compressor import (
    compressor_decode,
    compressor_decode_reference,
    pool_layout,
)
from atom.kernels.v4_indexer import indexer_topk_decode, indexer_topk_decode_reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,rows", [(4, 1), (5, 3), (128, 7)])
def test_write_window_matches_reference(device, window, rows):
    torch.manual_seed(window)
    ring = torch.randn(4, window, 32, device=device)
    expected = ring.clone()
    kv = torch.randn(rows, 32, device=device)
    slots = torch.tensor(([0, -1, 2] * rows)[:rows], device=device, dtype=torch.int32)
    positions = torch.randint(0, 5000, (rows,), device=device)
    write_window_reference(expected, kv, slots, positions)
    write_window(ring, kv, slots, positions)
    torch.testing.assert_close(ring, expected, rtol=0, atol=0)


def _case(device, dtype, window, positions, ratio, num_ids, heads=4, dim=32, block_size=16):
    torch.manual_seed(window + ratio + num_ids)
    rows = len(positions)
    positions = torch.tensor(positions, device=device)
    context_lens = (positions + 1).to(torch.int32)
    context_lens[-1] = 0  # a padded row
    slots = torch.arange(rows, device=device, dtype=torch.int32)
    slots[-1] = -1
    width = -(-(int(positions.max()) + 1) // block_size) + 1
    num_blocks = rows * width + 1
    tables = torch.randperm(num_blocks - 1, device=device)[: rows * width].view(rows, width)
    ring = torch.randn(rows + 1, window, dim, device=device, dtype=dtype)
    pool = torch.randn(num_blocks + 1, *pool_layout(block_size, ratio, dim), device=device,
                       dtype=dtype)  # fmt: skip
    visible = ((positions + 1) // ratio)[:, None]
    ids = torch.randint(0, 10**6, (rows, num_ids), device=device) % visible.clamp(min=1)
    ids = torch.where((visible > 0) & (torch.rand(rows, num_ids, device=device) < 0.8), ids, -1)
    q = torch.randn(rows, heads, dim, device=device, dtype=dtype)
    sinks = torch.randn(heads, device=device)
    return (
        q,
        ring,
        slots,
        positions,
        context_lens,
        pool,
        ids,
        tables.int(),
        ratio,
        block_size,
        sinks,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "window,positions,ratio,num_ids",
    [
        (4, [0, 9], 4, 1),
        (5, [3, 17, 40], 4, 3),
        (8, [100, 1000, 5], 128, 9),
        (16, [4095, 2], 4, 40),
    ],
)
@pytest.mark.parametrize("entries", ["chosen", "every_visible", "none"])
def test_decode_attention_matches_reference(device, window, positions, ratio, num_ids, entries):
    """Chosen ids (CSA), every visible entry (HCA: no id list, the count from the
    position) and window only; unsplit, and split in 3 (some splits empty for the short
    rows) and in 7 (more splits than most rows have tiles), merged with the sink; and
    split in 2 with another launch geometry (32 heads and 32 keys a tile)."""
    args = list(_case(device, torch.float32, window, positions, ratio, num_ids))
    if entries != "chosen":
        args[6] = None
    if entries == "none":
        args[5] = None
    expected = v4_decode_attention_reference(*args, scale=32**-0.5)
    for splits in (1, 3, 7):
        got = v4_decode_attention(*args, scale=32**-0.5, num_splits=splits)
        torch.testing.assert_close(got, expected, rtol=2e-4, atol=2e-4)
        assert got[-1].abs().max() == 0  # the padded row attends to nothing
    # another launch geometry (the benchmark's sweep): more heads and keys a tile than exist
    got = v4_decode_attention(*args, scale=32**-0.5, num_splits=2, block_h=32, block_n=32)
    torch.testing.assert_close(got, expected, rtol=2e-4, atol=2e-4)


@pytest.mark.gpu
def test_decode_attention_bf16_matches_reference():
    args = _case("cuda", torch.bfloat16, 128, [8191, 300, 64, 7], 4, 512, heads=64, dim=512)
    expected = v4_decode_attention_reference(*args, scale=512**-0.5)
    for splits in (None, 1):  # as the engine picks (split at this batch), and unsplit
        got = v4_decode_attention(*args, scale=512**-0.5, num_splits=splits)
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize(
    "overlap,ratio,length",
    [(True, 4, 1), (True, 4, 23), (False, 8, 37), (False, 16, 70), (False, 64, 140)],
)
def test_compressor_decode_matches_reference(device, dtype, overlap, ratio, length):
    """Token by token over a whole sequence (lengths 1 and non-multiples of the ratio),
    with a padded row beside it: same state, same pool."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 runs on CUDA")
    torch.manual_seed(ratio + length)
    dim, rope_half, block_size = 32, 4, 16
    width = 2 * dim if overlap else dim
    rows = 2 * ratio if overlap else ratio
    kv = torch.randn(length, width, device=device, dtype=dtype)
    gate = torch.randn(length, width, device=device, dtype=dtype)
    bias = torch.randn(ratio, width, device=device)
    weight = torch.rand(dim, device=device) + 0.5
    cos, sin = torch.randn(2, 256, rope_half, device=device)
    num_blocks = -(-length // block_size) + 2
    table = torch.randperm(num_blocks, device=device)[None].int()
    tables = torch.cat([table, table])
    states = [torch.zeros(3, rows, width, device=device, dtype=dtype) for _ in range(4)]
    pools = [
        torch.zeros(
            num_blocks + 1, *pool_layout(block_size, ratio, dim), device=device, dtype=dtype
        )  # fmt: skip
        for _ in range(2)
    ]
    slots = torch.tensor([1, -1], device=device, dtype=torch.int32)
    for t in range(length):
        step_kv, step_gate = torch.stack([kv[t], kv[t]]), torch.stack([gate[t], gate[t]])
        positions = torch.tensor([t, 0], device=device)
        for fn, (s_kv, s_gate), pool in (
            (compressor_decode_reference, states[:2], pools[0]),
            (compressor_decode, states[2:], pools[1]),
        ):
            fn(s_kv, s_gate, step_kv, step_gate, bias, weight, 1e-6, cos, sin, slots,
               positions, tables, pool, ratio, overlap, block_size)  # fmt: skip
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(states[2][:2], states[0][:2], rtol=0, atol=0)
    torch.testing.assert_close(pools[1][:-1].float(), pools[0][:-1].float(), **tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "positions,max_entries,topk", [([0, 5], 4, 2), ([3, 40, 17], 12, 4), ([4000, 1], 1024, 64)]
)
def test_indexer_topk_decode_matches_reference(device, positions, max_entries, topk):
    torch.manual_seed(max_entries + topk)
    heads, dim, ratio, block_size = 16, 32, 4, 16
    rows = len(positions)
    positions = torch.tensor(positions, device=device)
    context_lens = (positions + 1).int()
    context_lens[-1] = 0  # a padded row: nothing visible
    width = max_entries * ratio // block_size + 1
    num_blocks = rows * width + 1
    tables = torch.randperm(num_blocks - 1, device=device)[: rows * width].view(rows, width).int()
    pool = torch.randn(num_blocks + 1, block_size // ratio, dim, device=device)
    q = torch.randn(rows, heads, dim, device=device)
    weights = torch.randn(rows, heads, device=device)
    args = (q, weights, pool, tables, positions, context_lens, ratio, block_size, topk, max_entries)
    expected = indexer_topk_decode_reference(*args)
    got = indexer_topk_decode(*args)
    assert torch.equal(got, expected), (got, expected)
    assert (got[-1] == -1).all()


@pytest.mark.parametrize("device", DEVICES)
def test_index_scores_decode_writes_the_visible_counts(device):
    """The scoring launch writes each row's visible count (`visible_counts`, the select's
    input): capped at max_entries, 0 for a padded row; the scores equal the reference's."""
    from atom.kernels.v4_indexer import index_scores_decode, index_scores_decode_reference
    from atom.kernels.v4_topk import visible_counts

    torch.manual_seed(0)
    heads, dim, ratio, block_size, max_entries = 4, 16, 4, 16, 8
    positions = torch.tensor([100, 7, 3, 30], device=device)
    context_lens = torch.tensor([101, 8, 0, 31], device=device, dtype=torch.int32)
    tables = torch.arange(4 * 3, device=device, dtype=torch.int32).view(4, 3)
    pool = torch.randn(13, block_size // ratio, dim, device=device)
    q, weights = torch.randn(4, heads, dim, device=device), torch.randn(4, heads, device=device)
    args = (q, weights, pool, tables, positions, context_lens, ratio, block_size, max_entries)
    counts = torch.full((4,), -7, dtype=torch.int64, device=device)
    scores = index_scores_decode(*args, counts=counts)
    assert counts.tolist() == [8, 2, 0, 7]
    assert torch.equal(counts, visible_counts(positions, context_lens, ratio, max_entries))
    torch.testing.assert_close(scores, index_scores_decode_reference(*args))


def _rule_topk(scores: torch.Tensor, topk: int) -> list[list[int]]:
    """The tie rule by hand: visible (finite) scores, best first, the lower id among equals;
    the chosen ids in ascending order (the order the decode top-k writes)."""
    picks = []
    for row in scores.tolist():
        ranked = sorted((-s, i) for i, s in enumerate(row) if s != float("-inf"))
        chosen = sorted(i for _, i in ranked[:topk])
        picks.append(chosen + [-1] * (min(topk, len(row)) - len(chosen)))
    return picks


@pytest.mark.parametrize("device", DEVICES)
def test_indexer_topk_decode_exact_ties_pick_the_lower_entry(device):
    """Exact ties at the cut (keys opposite to every head's query: ReLU gives exact zeros,
    and repeated keys): the Triton scores + choice follow the rule, and a row's picks do not
    depend on the rows beside it or on the padded width (max_entries)."""
    from atom.kernels.v4_indexer import index_scores_decode_reference

    torch.manual_seed(3)
    heads, dim, ratio, block_size, topk = 4, 32, 4, 16, 6
    positions = torch.tensor([47, 47, 30], device=device)  # 12, 12 and 7 visible entries
    context_lens = (positions + 1).int()
    q = torch.randn(1, heads, dim, device=device).abs().expand(3, -1, -1).contiguous()
    weights = torch.tensor([[1.0, 0.5, -0.25, 2.0]], device=device).expand(3, -1).contiguous()
    keys = torch.randn(12, dim, device=device).abs()
    keys[[0, 2, 3, 5, 7, 8, 10]] *= -1  # every head's dot negative: score exactly 0
    keys[9] = keys[4]  # an exact positive tie too
    tables = torch.arange(1, 4, device=device).int()[None].expand(3, -1).contiguous()
    pool = torch.randn(5, block_size // ratio, dim, device=device)
    pool.view(-1, dim)[block_size // ratio : block_size // ratio + 12] = keys
    tables[1] = tables[0]  # rows 0 and 1: the same sequence, the same query
    picks = []
    for max_entries in (12, 64):
        args = (q, weights, pool, tables, positions, context_lens, ratio, block_size, topk,
                max_entries)  # fmt: skip
        scores = index_scores_decode_reference(*args[:8], max_entries)
        assert (scores[0, :12] == 0).sum() >= 7
        got = indexer_topk_decode(*args)
        assert got.tolist() == _rule_topk(scores, topk), (got, scores)
        assert torch.equal(got, indexer_topk_decode_reference(*args))
        one = indexer_topk_decode(q[:1], weights[:1], pool, tables[:1], positions[:1],
                                  context_lens[:1], ratio, block_size, topk, max_entries)  # fmt: skip
        assert torch.equal(one[0], got[0]) and torch.equal(got[1], got[0])
        picks.append(got[0].tolist())
    assert picks[0] == picks[1]

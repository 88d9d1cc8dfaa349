"""DeepSeek-V4 prefill kernels against their torch references (CPU interpreter; `gpu`
variants on CUDA): the sparse prefill attention (window only, every visible entry (HCA),
chosen ids with -1 padding (CSA), the sink, queries from position 0 and a chunk starting
mid-sequence) and the indexer's top-k with the query tokens as rows."""

import pytest
import torch

from atom.kernels.v4_compressor import pool_layout, store_entries
from atom.kernels.v4_indexer import indexer_topk_prefill, indexer_topk_prefill_reference
from atom.kernels.v4_prefill_attention import (
    v4_prefill_attention,
    v4_prefill_attention_reference,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _chosen_ids(positions, ratio, k, generator, device):
    """Each query's picks among its visible entries (random order, no repeats), -1 after
    them; some rows pick fewer than they could (as a candidate-restricted select may)."""
    rows = []
    for p in positions.tolist():
        visible = (p + 1) // ratio
        picks = torch.randperm(visible, generator=generator)[: min(k, visible)]
        picks = picks[: max(0, len(picks) - int(torch.randint(0, 2, (), generator=generator)))]
        rows.append(torch.cat([picks, torch.full((k - len(picks),), -1)]))
    return torch.stack(rows).to(device)


def _case(device, dtype, window, query_start, num_queries, ratio, heads, dim, entries):
    """(arguments of `v4_prefill_attention`): window keys from the first one the first
    query needs, entries up to the last query's, each query's ids (CSA) or None."""
    generator = torch.Generator().manual_seed(window + query_start + num_queries + ratio)
    end = query_start + num_queries
    key_first = max(0, query_start - window + 1)
    keys = torch.randn(end - key_first, dim, generator=generator).to(device, dtype)
    q = torch.randn(num_queries, heads, dim, generator=generator).to(device, dtype)
    sinks = torch.randn(heads, generator=generator).to(device)
    pooled = ids = None
    if entries != "none":
        pooled = torch.randn(end // ratio, dim, generator=generator).to(device, dtype)
    if entries == "chosen":
        positions = torch.arange(query_start, end)
        ids = _chosen_ids(positions, ratio, 5, generator, device).int()
    return q, keys, key_first, query_start, pooled, ids, ratio, window, sinks, dim**-0.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "window,query_start,num_queries,ratio,heads,dim",
    [
        (8, 0, 1, 4, 4, 32),  # one query, nothing compressed yet
        (8, 0, 45, 4, 4, 32),  # from the start: windows shorter than 8, then full
        (5, 37, 19, 4, 20, 48),  # a chunk mid-sequence; window 5, 2 head blocks, dim 48
        (16, 100, 33, 16, 4, 32),  # HCA-like ratio, keys from the ring's older positions
    ],
)
@pytest.mark.parametrize("entries", ["none", "every_visible", "chosen"])
def test_prefill_attention_matches_reference(
    device, window, query_start, num_queries, ratio, heads, dim, entries
):
    args = _case(
        device, torch.float32, window, query_start, num_queries, ratio, heads, dim, entries
    )
    expected = v4_prefill_attention_reference(*args)
    got = v4_prefill_attention(*args, block_h=16, block_n=16)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_prefill_attention_chunks_agree_with_the_whole():
    """Queries of one sequence split at any point attend exactly as the whole: each query's
    keys come from its position, not from the chunk (the engine's chunked prefill)."""
    q, keys, _, _, pooled, ids, ratio, window, sinks, scale = _case(
        "cpu", torch.float32, 8, 0, 40, 4, 4, 32, "chosen"
    )
    whole = v4_prefill_attention(q, keys, 0, 0, pooled, ids, ratio, window, sinks, scale)
    for split in (1, 13, 39):
        first = max(0, split - window + 1)
        tail = v4_prefill_attention(
            q[split:], keys[first:], first, split, pooled, ids[split:], ratio, window,
            sinks, scale,
        )  # fmt: skip
        torch.testing.assert_close(tail, whole[split:], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_attention_before_the_first_entry(device):
    """A compressed layer before its first entry closes: no entries and an empty id list
    (CSA's select of nothing) attend the window and the sink alone."""
    q, keys, *_, sinks, scale = _case(device, torch.float32, 8, 0, 3, 4, 4, 32, "none")
    no_entries = keys.new_empty(0, 32)
    expected = v4_prefill_attention_reference(q, keys, 0, 0, None, None, 4, 8, sinks, scale)
    for ids in (None, torch.empty(3, 0, dtype=torch.int64, device=device)):
        got = v4_prefill_attention(q, keys, 0, 0, no_entries, ids, 4, 8, sinks, scale)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("entries", ["every_visible", "chosen"])
def test_prefill_attention_bf16_at_the_model_shape(entries):
    """64 heads of 512, window 128, a 600-query chunk at position 3000 (bf16 tensor-core
    dots against the fp32 reference of the same inputs)."""
    ratio = 128 if entries == "every_visible" else 4
    args = list(_case("cuda", torch.bfloat16, 128, 3000, 600, ratio, 64, 512, entries))
    if entries == "chosen":  # 512 picks a query, as CSA's top-k
        generator = torch.Generator().manual_seed(0)
        positions = torch.arange(3000, 3600)
        args[5] = _chosen_ids(positions, ratio, 512, generator, "cuda")
    expected = v4_prefill_attention_reference(*args)
    got = v4_prefill_attention(*args)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "query_start,num_queries,ratio,topk,rows_per_launch",
    [
        (0, 1, 4, 3, 1024),
        (0, 70, 4, 5, 1024),
        (33, 41, 4, 6, 16),
        (3, 50, 8, 64, 7),
        (300, 20, 4, 16, 1024),  # 3 scorer programs a row, one tile each
        (0, 300, 4, 8, 1024),  # 2 programs a row striding over 3 tiles
    ],
)
def test_indexer_topk_prefill_matches_reference(
    device, query_start, num_queries, ratio, topk, rows_per_launch
):
    """The query tokens as rows of the decode scorer and select: the same ids (ascending,
    -1 after) as `select_topk` over dense scores, with launches of a few rows each and
    the scorer's entries split over `prefill_splits` programs a row."""
    generator = torch.Generator().manual_seed(query_start + num_queries)
    heads, dim, block_size = 8, 16, 16
    end = query_start + num_queries
    num_blocks = -(-end // block_size) + 3
    table = torch.randperm(num_blocks, generator=generator)[None].int().to(device)
    pool = torch.zeros(num_blocks + 1, *pool_layout(block_size, ratio, dim), device=device)
    ids = torch.arange(end // ratio, device=device)[None]
    keys = torch.randn(1, end // ratio, dim, generator=generator).to(device)
    store_entries(pool, table, ids, keys, ratio, block_size)
    q = torch.randn(num_queries, heads, dim, generator=generator).to(device)
    weights = torch.randn(num_queries, heads, generator=generator).to(device)
    args = (q, weights, pool, table, query_start, ratio, block_size, topk)
    expected = indexer_topk_prefill_reference(*args)
    got = indexer_topk_prefill(*args, rows_per_launch=rows_per_launch)
    assert torch.equal(got, expected)

"""Shard math of the tensor-parallel layers, checked in one process.

Each rank's layer is built with a stand-in group whose collectives do nothing; the test
performs them by hand (sum for all-reduce, concatenation for the logits gather) and
compares with the unsharded computation. Real collectives are covered by
tests/model_engine/test_tensor_parallel.py.
"""

import pytest
import torch
import torch.nn.functional as F

from atom.distributed import ShardingError
from atom.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_parameter,
)


class RankOnly:
    """A rank of a `world_size` group whose collectives are left to the test."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.is_first = rank, world_size, rank == 0

    def all_reduce(self, x):
        return x

    def gather_to_first(self, x, dim=-1):
        return x


def ranks(n):
    return [RankOnly(r, n) for r in range(n)]


def test_qkv_split_keeps_whole_heads_and_gqa_groups():
    hidden, head_dim, heads, kv_heads, world = 8, 2, 4, 2, 2
    torch.manual_seed(0)
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    bias = {name: torch.randn(t.shape[0]) for name, t in zip("qkv", (q, k, v), strict=True)}
    x = torch.randn(3, hidden)
    for tp in ranks(world):
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, True, tp)
        for name, weight in zip("qkv", (q, k, v), strict=True):
            load_parameter(layer.weight, weight, name, f"{name}_proj.weight")
            load_parameter(layer.bias, bias[name], name, f"{name}_proj.bias")
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        out_q, out_k, out_v = layer(x).split([2 * head_dim, head_dim, head_dim], dim=-1)
        rows = slice(tp.rank * 2 * head_dim, (tp.rank + 1) * 2 * head_dim)  # query heads 2r, 2r+1
        kv_rows = slice(tp.rank * head_dim, (tp.rank + 1) * head_dim)  # their KV head r
        torch.testing.assert_close(out_q, F.linear(x, q[rows], bias["q"][rows]))
        torch.testing.assert_close(out_k, F.linear(x, k[kv_rows], bias["k"][kv_rows]))
        torch.testing.assert_close(out_v, F.linear(x, v[kv_rows], bias["v"][kv_rows]))


def test_gate_up_then_down_sums_to_the_full_mlp():
    hidden, inter, world = 6, 8, 2
    torch.manual_seed(1)
    gate, up, down = (
        torch.randn(inter, hidden),
        torch.randn(inter, hidden),
        torch.randn(hidden, inter),
    )
    x = torch.randn(4, hidden)
    full = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    total = torch.zeros_like(full)
    for tp in ranks(world):
        gate_up = ColumnParallelLinear(hidden, [inter, inter], False, tp)
        load_parameter(gate_up.weight, gate, 0, "gate_proj.weight")
        load_parameter(gate_up.weight, up, 1, "up_proj.weight")
        row = RowParallelLinear(inter, hidden, False, tp)
        load_parameter(row.weight, down, None, "down_proj.weight")
        g, u = gate_up(x).chunk(2, dim=-1)
        total += row(F.silu(g) * u)  # the all-reduce, by hand
    torch.testing.assert_close(total, full)


def test_vocab_parallel_embedding_and_head_pad_an_odd_vocabulary():
    vocab, hidden, world = 10, 4, 4  # 3 rows per rank, the last rank has 2 padding rows
    torch.manual_seed(2)
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 2, 3, 5, 9, 8])
    hidden_states = torch.randn(5, hidden)
    rows = torch.zeros(len(ids), hidden)
    logits = []
    for tp in ranks(world):
        embedding = VocabParallelEmbedding(vocab, hidden, tp)
        load_parameter(embedding.weight, table, None, "embed_tokens.weight")
        rows += embedding(ids)
        head = ParallelLMHead(vocab, hidden, tp)
        head.weight = embedding.weight  # tied
        logits.append(F.linear(hidden_states, head.weight))
    torch.testing.assert_close(rows, table[ids])
    gathered = torch.cat(logits, dim=-1)
    assert gathered.shape[-1] == 12 and torch.all(gathered[:, vocab:] == 0)
    torch.testing.assert_close(gathered[:, :vocab], F.linear(hidden_states, table))


def test_one_rank_is_the_plain_layer_bit_for_bit():
    torch.manual_seed(3)
    weight, x = torch.randn(12, 8), torch.randn(5, 8)
    layer = ColumnParallelLinear(8, [12], False)
    load_parameter(layer.weight, weight, None, "w")
    assert torch.equal(layer(x), F.linear(x, weight))
    head = ParallelLMHead(12, 8)
    load_parameter(head.weight, weight, None, "lm_head.weight")
    assert torch.equal(head.compute_logits(x), F.linear(x, weight))


def test_uneven_heads_and_wrong_shapes_are_clear_errors():
    with pytest.raises(ShardingError, match="num_key_value_heads \\(2\\).*tensor_parallel_size 4"):
        QKVParallelLinear(16, 2, 8, 2, False, RankOnly(0, 4))
    layer = RowParallelLinear(8, 4, False, RankOnly(1, 2))
    with pytest.raises(ValueError, match="'down_proj.weight' has shape \\(4, 6\\).*\\(4, 8\\)"):
        load_parameter(layer.weight, torch.zeros(4, 6), None, "down_proj.weight")

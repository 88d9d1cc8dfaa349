"""Tensor-parallel shards of quantized linear layers, checked in one process (as
test_parallel_layers.py): each rank's FP8 / int4 layer computes its slice of the product
with the whole dequantized weight, and shards that would split a scale block or group are
refused."""

import pytest
import torch
import torch.nn.functional as F

from atom.models.load_error import ModelLoadError
from atom.models.parallel_layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    load_parameter,
)
from atom.models.quantization import Fp8Weight, Int4Weight, QuantizationScheme, linear_method
from tests.models.test_parallel_layers import ranks

FP8_BLOCK = QuantizationScheme("fp8", "fp8", block=(32, 32))
FP8_CHANNEL = QuantizationScheme("fp8", "compressed-tensors")
INT4_GROUP = QuantizationScheme("int4", "gptq", group_size=16, symmetric=False)
INT4_CHANNEL = QuantizationScheme("int4", "awq", symmetric=False)


def fp8_weight(rows, cols, block, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=generator) * 50).to(torch.float8_e4m3fn)
    rb, cb = block or (1, cols)
    scale = torch.rand(-(-rows // rb), -(-cols // cb), generator=generator) + 0.5
    return Fp8Weight(f"w{seed}", weight, scale, (rb, cb))


def int4_weight(rows, cols, group, seed):
    generator = torch.Generator().manual_seed(seed)
    groups = cols // (group or cols)
    values = torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.uint8)
    zero = torch.randint(0, 16, (rows, groups), generator=generator, dtype=torch.uint8)
    scale = torch.rand(rows, groups, generator=generator) + 0.5
    return Int4Weight(f"w{seed}", values, scale, zero, group or cols)


def make(scheme, rows, cols, seed):
    if scheme.kind == "fp8":
        return fp8_weight(rows, cols, scheme.block, seed)
    return int4_weight(rows, cols, scheme.group_size, seed)


@pytest.mark.parametrize("scheme", [FP8_BLOCK, FP8_CHANNEL, INT4_GROUP, INT4_CHANNEL])
def test_qkv_and_row_shards_compute_the_full_product(scheme):
    hidden, head_dim, heads, kv_heads, world = 64, 16, 4, 2, 2
    parts = {
        "q": make(scheme, heads * head_dim, hidden, 1),
        "k": make(scheme, kv_heads * head_dim, hidden, 2),
        "v": make(scheme, kv_heads * head_dim, hidden, 3),
    }
    down = make(scheme, hidden, hidden, 4)
    x = torch.randn(3, hidden)
    full = {name: F.linear(x, w.dequantize(torch.float32)) for name, w in parts.items()}
    total = torch.zeros(3, hidden)
    for tp in ranks(world):
        qkv = QKVParallelLinear(
            hidden, head_dim, heads, kv_heads, False, tp, quant_method=linear_method(scheme)
        )
        for name, weight in parts.items():
            load_parameter(qkv.weight, weight, name, f"{name}_proj.weight")
        q, k, v = qkv(x).split([2 * head_dim, head_dim, head_dim], dim=-1)
        torch.testing.assert_close(q, full["q"][:, tp.rank * 32 : (tp.rank + 1) * 32])
        torch.testing.assert_close(k, full["k"][:, tp.rank * 16 : (tp.rank + 1) * 16])
        torch.testing.assert_close(v, full["v"][:, tp.rank * 16 : (tp.rank + 1) * 16])
        row = RowParallelLinear(hidden, hidden, False, tp, quant_method=linear_method(scheme))
        load_parameter(row.weight, down, None, "o_proj.weight")
        local = x[:, tp.rank * 32 : (tp.rank + 1) * 32]
        total += row(local)  # the all-reduce, by hand
    expected = F.linear(x, down.dequantize(torch.float32))  # one sum where the ranks make two
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6 * expected.abs().max())


def test_fp8_block_scales_stay_blocks_when_parts_align():
    gate_up = ColumnParallelLinear(64, [64, 64], False, quant_method=linear_method(FP8_BLOCK))
    assert gate_up.weight_block == (32, 32) and gate_up.weight_scale.shape == (4, 2)
    # k starts at row 64, v at 80: inside a block
    qkv = QKVParallelLinear(64, 16, 4, 1, False, quant_method=linear_method(FP8_BLOCK))
    assert qkv.weight_block == (1, 32) and qkv.weight_scale.shape == (96, 2)


@pytest.mark.parametrize("scheme", [FP8_BLOCK, INT4_GROUP])
def test_a_shard_inside_a_scale_block_or_group_is_refused(scheme):
    with pytest.raises(ModelLoadError, match="tensor-parallel"):  # inputs 24..47 of 48
        RowParallelLinear(48, 8, False, ranks(2)[1], quant_method=linear_method(scheme))


def test_a_fused_layer_quantized_in_part_is_refused():
    from atom.models.parallel_layers import linear_method_for

    scheme = QuantizationScheme("fp8", "compressed-tensors", ignore=("re:.*k_proj",))
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    with pytest.raises(ModelLoadError, match="fuses them into one layer"):
        linear_method_for(scheme, names, "model.layers.0.self_attn")
    assert linear_method_for(scheme, names[:1], "q") is not None
    assert linear_method_for(scheme, names[1:2], "k") is None

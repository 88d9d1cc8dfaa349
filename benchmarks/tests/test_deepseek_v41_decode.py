"""benchmarks/deepseek_v41_decode.py: its config from the reference checkpoint's and the KV
bytes a decode step reads, against a hand count."""

import os
from types import SimpleNamespace

import pytest
import torch

from benchmarks import deepseek_v41_decode as bench

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(bench.REFERENCE, "config.json")),
    reason="needs ../shared/reference/deepseek_v41 beside the checkout",
)


def _llm(dtype):
    runner = SimpleNamespace(_kv_cache_dtype=lambda: dtype)
    return SimpleNamespace(engine=SimpleNamespace(model_runner=runner))


def test_state_read_of_the_tiny_shape_by_hand():
    config = bench.v41_config(tiny=True, max_position=512)
    assert config["engram_layer_ids"] == [] and config["compress_ratios"] == [0, 2, 2, 1, 1, 1]
    # 96 tokens, head_dim 32, window 8, top-6, index keys of 32 on layers 1, 3 and 5:
    # window 6 x 8 rows; ratio-2 layers 6 entries each (+ 48 index keys on layer 1);
    # ratio-1 layers 6 entries each (+ 96 index keys on layers 3 and 5)
    rows = 6 * 8 * 32 + 5 * 6 * 32 + (48 + 96 + 96) * 32
    assert rows == 10176
    assert bench.v41_state_read(_llm(torch.bfloat16), config, 3, 96) == 3 * rows * 2


def test_the_wide_shape_keeps_the_rotary_width_of_v4():
    config = bench.v41_config(tiny=False, max_position=9000)
    assert config["hidden_size"] == 4096 and config["head_dim"] == 512
    for rope in config["rope_parameters"].values():
        assert rope["partial_rotary_factor"] * 512 == config["qk_rope_head_dim"] == 64

"""A DeepSeek-V4.1 shape (the released layer ratios, 4 KV sources) and its KV bytes per token
from the v41 backend's real layout: the memory test and the memory benchmark share them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from atom.attention.family import layer_state
from atom.attention.v41 import V41Attention

RATIOS = [0, 0] + [2] * 18 + [1] * 20
SOURCES = [2, 11, 20, 30]  # two ratio-2 and two ratio-1 KV sources


def v41_shape(sources=SOURCES, engram: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        head_dim=512, sliding_window=128, compress_ratios=RATIOS, kv_source_layer_ids=sources,
        index_source_layer_ids=sources, index_head_dim=128, index_topk=512,
        candidate_source_layer_id=-1, candidate_topk_blocks=0, candidate_block_size=1,
        engram_max_ngram_size=4 if engram else 0,
    )  # fmt: skip


def bytes_per_token(config, block_size: int, context: int, itemsize: int = 2) -> dict:
    layers = [
        V41Attention(config, i, context, 3 if i == 0 and config.engram_max_ngram_size else 0)
        for i in range(len(config.compress_ratios))
    ]
    paged = sum(a.block_bytes(block_size, itemsize) for a in layers) / block_size
    cache_dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}[itemsize]
    state = sum(spec.bytes_per_slot for spec in layer_state(layers, cache_dtype))
    return {"paged": paged, "state_per_sequence": state, "total": paged + state / context}

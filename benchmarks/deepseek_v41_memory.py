"""KV bytes per token of a DeepSeek-V4.1 shape, from the v41 backend's real layout.

    python -m benchmarks.deepseek_v41_memory [--context 65536] [--block-size 16]

The released layer ratios ``[0, 0] + [2] * 18 + [1] * 20`` with 4 KV sources (two ratio-2,
two ratio-1, every source an index source), head_dim 512, index_head_dim 128, window 128,
bf16: the paged pools (`pool_shapes`, per page-table block) and the per-sequence state
(`state_shapes`, amortised over `--context` tokens), beside the same layers without
KV-source sharing and a full-attention cache of the same head shape. One JSON line.
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

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
    state = 0
    for a in layers:
        for shape in a.state_shapes().values():
            size = shape[2].itemsize if len(shape) > 2 else itemsize
            state += shape[0] * shape[1] * size
    return {"paged": paged, "state_per_sequence": state, "total": paged + state / context}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    shared = bytes_per_token(v41_shape(), args.block_size, args.context)
    compressed = [i for i, r in enumerate(RATIOS) if r]
    unshared = bytes_per_token(v41_shape(compressed), args.block_size, args.context)
    dims = 512 * 2 * len(RATIOS)
    record = {
        "context": args.context,
        "block_size": args.block_size,
        "v41_shared_sources": shared,
        "v41_without_sharing": unshared,
        "full_attention_one_kv_head": dims,
        "full_attention_k_and_v": 2 * dims,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()

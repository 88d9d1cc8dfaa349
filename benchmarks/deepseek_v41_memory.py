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

import torch

from tests.support.deepseek_v41_shapes import RATIOS, bytes_per_token, v41_shape


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

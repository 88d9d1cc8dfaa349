"""`python3 -m benchmarks.gemv_tall`: the batch-1 GEMV on tall weights (LM heads), by tile.

An LM head is the one weight of a decode step much larger than L2 with a short K
(Llama-3.2-1B: 128,256 x 2,048; Qwen3-Next: 151,936 x 2,048): rows of 4 KB, tens of
thousands of programs. This times, for each such shape, cuBLAS (F.linear), the GEMV's
heuristic tile and a grid of tiles (BLOCK_N 1..16, BLOCK_K 256..2048, 4 or 8 warps, 1 or 2
stages, 8..64 weight elements a thread), each as a CUDA graph of `--calls` calls (the
in-graph launch gap included, as in the decode graph), median of `--replays` replays; one
weight copy (it is many times the L2). Prints one JSON line per candidate (`us`, `gb_s`,
`of_stream`: of a streaming read measured in the same run) and the best per shape.
GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

SHAPES = {
    "llama-3.2-1b": (128256, 2048),
    "qwen3-next": (151936, 2048),
    "smollm2-135m": (49152, 576),
    "llama-3.1-8b": (128256, 4096),
}


def graph_us(fn, calls: int, replays: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def grid(in_features: int):
    from atom.kernels.gemv_tiles import GemvConfig

    for block_n in (1, 2, 4, 8, 16):
        for block_k in (256, 512, 1024, 2048):
            if block_k > in_features * 2:
                continue
            for warps in (4, 8):
                per_thread = block_n * block_k // (warps * 32)
                if not 8 <= per_thread <= 64:
                    continue
                for stages in (1, 2):
                    if stages > 1 and block_k >= in_features:
                        continue
                    yield GemvConfig(block_n, block_k, warps, stages)


def sweep_shape(shape: str, args, stream: float) -> None:
    """Every candidate on one shape, a JSON line each, then the five fastest."""
    from atom.kernels.gemv import gemv
    from atom.kernels.gemv_tiles import heuristic_config

    rows, cols = SHAPES[shape]
    generator = torch.Generator("cuda").manual_seed(0)
    weight = torch.randn(rows, cols, device="cuda", generator=generator).bfloat16() * 0.02
    x = torch.randn(1, cols, device="cuda", generator=generator).bfloat16()
    nbytes = weight.numel() * weight.element_size()
    reference = F.linear(x, weight).float()
    results = []

    def record(label, fn):
        try:
            gap = float((fn().float() - reference).abs().max())
            us = graph_us(fn, args.calls, args.replays)
        except Exception as error:  # noqa: BLE001 (a tile this Triton refuses)
            print(json.dumps(dict(case="tall_gemv", shape=shape, tile=label,
                                  error=type(error).__name__)), flush=True)  # fmt: skip
            return
        line = dict(case="tall_gemv", shape=shape, tile=label, us=round(us, 2),
                    gb_s=round(nbytes / us / 1e3, 1),
                    of_stream=round(nbytes / us / 1e-6 / stream, 3), max_gap=gap)  # fmt: skip
        results.append(line)
        print(json.dumps(line), flush=True)

    record("cublas", lambda: F.linear(x, weight))
    heuristic = heuristic_config(cols, rows, False)
    record(f"heuristic {heuristic}", lambda: gemv(x, weight, heuristic))
    for config in grid(cols):
        record(str(config), lambda config=config: gemv(x, weight, config))
    for line in sorted(results, key=lambda line: line["us"])[:5]:
        print(f"{shape}: {line['tile']}: {line['us']} us {line['gb_s']} GB/s "
              f"({line['of_stream']} of the streaming read)", file=sys.stderr)  # fmt: skip


def main(argv=None) -> int:
    from benchmarks.harness import streaming_bandwidth

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=["llama-3.2-1b", "qwen3-next"],
                        choices=sorted(SHAPES))  # fmt: skip
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=5)
    args = parser.parse_args(argv)
    stream = streaming_bandwidth()["stream_read"]
    print(json.dumps(dict(case="stream_read", gb_s=round(stream / 1e9, 1))), flush=True)
    for shape in args.shapes:
        sweep_shape(shape, args, stream)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

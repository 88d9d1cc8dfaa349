"""Paged decode attention at small batches (GPU, about 1-2 minutes on an H200): the decode
kernel + split merge of today, its in-kernel merge (Fusions.decode_merge) and the one-launch
kernel (Fusions.decode_short, atom/kernels/decode_attention_short.py) over its candidate
configurations; prints the best per case and the config table to paste into
``CONFIGS`` of atom/kernels/decode_attention_short.py.

    python -m benchmarks.decode_attention_sweep            # L2 warm (KV in L2)
    python -m benchmarks.decode_attention_sweep --cold     # L2 flushed before each call
    python -m benchmarks.decode_attention_sweep --quick    # fewer candidates
    python -m benchmarks.decode_attention_sweep --device cpu   # a plumbing check:
        # tiny sizes under TRITON_INTERPRET=1, one eager call per path, no timing

Cases: head geometries Llama-3.2-1B (32 q / 8 kv heads, head_dim 64) and SmolLM2-135M (9 q /
3 kv heads, head_dim 64), bf16 q and cache, the engine's block size (Config.block_size),
batch 1, 2, 4 (every row at the same context), contexts 64..4096, and block tables as wide
as --max-model-len (a CUDA graph is captured at that width and replayed at any shorter
context: the split counts follow the width, the engine's offline benchmark uses ~400 tokens
and the engine's default cap is 8192). Contexts longer than the table are skipped.

Timing, as the engine replays: a CUDA graph of --layers calls, one per layer, each on its
own K/V cache and output, sharing q, the block table and the context lengths; the median of
--repeats replays over the number of calls: device us per call. ``--cold`` puts an L2 flush
(a 128 MiB memset) before each call and subtracts the flush alone, measured the same way.
Each path's output of the first layer is checked against the torch reference (``max_err``).

Output: with ``--jsonl PATH`` one JSON line per (case, path) (``case: decode_sweep``) in
that file (on stdout only those whose output is wrong), then per geometry a table:
the per-case best path, and the configuration chosen for the geometry (one compiled variant
must serve every case: the candidate with the smallest worst-case slowdown against the
per-case best, ties by the total), its speed-up over today's kernel per case, and the
``CONFIGS`` entries to paste, between ``--- paste`` markers. The ``decode_sweep_choice``
line also names the best configuration for batch 1 at contexts <= 512 alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from atom.config import Config
from benchmarks.harness import emit

GEOMETRIES = {"llama-3.2-1b": (32, 8, 64), "smollm2-135m": (9, 3, 64)}
BATCHES = [1, 2, 4]
CONTEXTS = [64, 128, 256, 384, 512, 1024, 2048, 4096]
MAX_MODEL_LENS = [512, 8192]
BLOCK_SIZE = Config.block_size
BASELINES = ["decode+merge", "decode_merge"]


def candidates(quick: bool = False):
    """The one-launch kernel's configurations the sweep tries (the geometry's current entry
    of CONFIGS and DEFAULT_CONFIG among them)."""
    from atom.kernels.decode_attention_short import CONFIGS, DEFAULT_CONFIG, ShortDecodeConfig

    found = []
    for block_n, warps in ((32, (2, 4)), (64, (2, 4)), (128, (4, 8)), (256, (4, 8))):
        for num_warps in warps:
            # 32-token tiles: many short trips; 256: one or two a split. Pipelining in between.
            for num_stages in (1,) if quick or block_n in (32, 256) else (1, 2):
                for tiles in (1, 2) if quick else (1, 2, 4):
                    split_tokens = tiles * block_n
                    found.append(ShortDecodeConfig(block_n, split_tokens, num_warps, num_stages))
                    if split_tokens <= 128 and not quick:  # the grid's cap bites: lift it
                        found.append(
                            ShortDecodeConfig(block_n, split_tokens, num_warps, num_stages, 16)
                        )
    for config in (DEFAULT_CONFIG, *CONFIGS.values()):
        if config not in found:
            found.append(config)
    return found


def label(config) -> str:
    if isinstance(config, str):
        return config
    return (
        f"n{config.block_n}-s{config.split_tokens}-w{config.num_warps}-st{config.num_stages}"
        f"-p{config.programs_per_sm}"
    )


# -- timing --------------------------------------------------------------------------------


def graph_us(calls: list[Callable[[], object]], repeats: int, flush=None) -> float:
    """Median device us per call of a CUDA graph of ``calls`` (each after ``flush``)."""
    from atom.graph_capture import capture_graph

    def body():
        for call in calls:
            if flush is not None:
                flush()
            call()

    body()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph, _ = capture_graph(body)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / len(calls))
    del graph
    return statistics.median(samples)


class Layers:
    """``layers`` K/V caches of one geometry, large enough for max_batch x max_context."""

    def __init__(self, geometry, layers, max_batch, max_context, device, dtype, seed=0):
        self.num_q_heads, self.num_kv_heads, self.head_dim = geometry
        self.device, self.dtype = device, dtype
        self.generator = torch.Generator().manual_seed(seed)
        self.num_blocks = max_batch * -(-max_context // BLOCK_SIZE) + 8
        shape = (self.num_blocks, BLOCK_SIZE, self.num_kv_heads, self.head_dim)
        self.k = [torch.randn(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.randn(shape, device=device, dtype=dtype) for _ in range(layers)]
        out_shape = (max_batch, self.num_q_heads, self.head_dim)
        self.out = [torch.empty(out_shape, device=device, dtype=dtype) for _ in range(layers)]

    def inputs(self, batch, context, max_model_len):
        """(q, block_tables, context_lens): distinct shuffled blocks per row (as the block
        manager hands them out), random valid ids past each context."""
        width = -(-max_model_len // BLOCK_SIZE)
        used = -(-context // BLOCK_SIZE)
        tables = torch.randint(0, self.num_blocks, (batch, width), generator=self.generator)
        ids = torch.randperm(self.num_blocks, generator=self.generator)[: batch * used]
        tables[:, :used] = ids.view(batch, used)
        q = torch.randn(batch, self.num_q_heads, self.head_dim, generator=self.generator)
        lens = torch.full((batch,), context, dtype=torch.int32)
        to = dict(device=self.device)
        return q.to(**to, dtype=self.dtype), tables.to(**to, dtype=torch.int32), lens.to(**to)


def path_calls(layers: Layers, path, q, tables, lens) -> list[Callable[[], object]]:
    from atom.kernels.decode_attention import paged_decode_attention
    from atom.kernels.decode_attention_short import paged_decode_attention_short

    batch, scale = q.shape[0], layers.head_dim**-0.5
    calls = []
    for k, v, out in zip(layers.k, layers.v, layers.out, strict=True):
        args = (q, k, v, tables, lens, scale)
        if path == "decode+merge":
            call = lambda a=args, o=out[:batch]: paged_decode_attention(*a, out=o)  # noqa: E731
        elif path == "decode_merge":
            call = lambda a=args, o=out[:batch]: paged_decode_attention(  # noqa: E731
                *a, out=o, merge_in_kernel=True
            )
        else:
            call = lambda a=args, o=out[:batch], c=path: paged_decode_attention_short(  # noqa: E731
                *a, out=o, config=c
            )
        calls.append(call)
    return calls


# -- choosing one configuration per geometry ----------------------------------------------


def choose(times: dict[tuple, dict[str, float]], names: list[str]) -> str:
    """The candidate whose worst slowdown against each case's best candidate is smallest
    (ties: the smallest total time). ``times``: case -> path label -> us."""

    def score(name):
        worst = max(per_case[name] / min(per_case[n] for n in names) for per_case in times.values())
        return worst, sum(per_case[name] for per_case in times.values())

    return min(names, key=score)


def config_table(chosen: dict[tuple[int, int, int], object]) -> str:
    lines = ["CONFIGS: dict[tuple[int, int, int], ShortDecodeConfig] = {"]
    for geometry, config in chosen.items():
        lines.append(f"    {geometry}: ShortDecodeConfig(")  # as ruff format writes it
        lines.append(
            f"        block_n={config.block_n}, split_tokens={config.split_tokens}, "
            f"num_warps={config.num_warps}, num_stages={config.num_stages}, "
            f"programs_per_sm={config.programs_per_sm}"
        )
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines)


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(geometry_name, geometry, times, configs) -> object:
    """Print the geometry's table; returns the chosen config."""
    by_label = {label(c): c for c in configs}
    names = list(by_label)
    chosen = choose(times, names)
    print(f"\n== {geometry_name} {geometry} (us per call; x = today's decode+merge / chosen)")
    print(f"{'batch':>5} {'max_len':>7} {'ctx':>5} {'decode+merge':>12} {'decode_merge':>12} "
          f"{'best':>7} {'best config':<20} {'chosen':>7} {'x':>5}")  # fmt: skip
    speedups, batch1_short = [], []
    for (batch, max_model_len, context), per_path in times.items():
        best = min(names, key=per_path.__getitem__)
        speedup = per_path["decode+merge"] / per_path[chosen]
        speedups.append(speedup)
        if batch == 1 and context <= 512:
            batch1_short.append(speedup)
        print(f"{batch:>5} {max_model_len:>7} {context:>5} {per_path['decode+merge']:>12.2f} "
              f"{per_path['decode_merge']:>12.2f} {per_path[best]:>7.2f} {best:<20} "
              f"{per_path[chosen]:>7.2f} {speedup:>5.2f}")  # fmt: skip
    short = {case: t for case, t in times.items() if case[0] == 1 and case[2] <= 512}
    emit(
        case="decode_sweep_choice",
        geometry=geometry_name,
        heads=list(geometry),
        chosen=chosen,
        chosen_for_batch1_ctx_le_512=choose(short, names) if short else None,
        speedup_geomean=round(geomean(speedups), 3),
        speedup_worst=round(min(speedups), 3),
        speedup_batch1_ctx_le_512=round(geomean(batch1_short), 3) if batch1_short else None,
    )
    return by_label[chosen]


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    parser.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    parser.add_argument("--max-model-len", type=int, nargs="+", default=MAX_MODEL_LENS)
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES))
    parser.add_argument("--layers", type=int, default=16, help="calls (caches) per graph")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="fewer candidate configurations")
    parser.add_argument("--cold", action="store_true", help="flush L2 before each call")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--jsonl", help="write one JSON line per (case, path) to this file")
    args = parser.parse_args(argv)
    smoke = args.device == "cpu"
    if smoke:  # the plumbing on CPU: tiny sizes, the interpreter, no timing
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--device cpu needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        args.batches, args.contexts, args.max_model_len, args.layers = [1, 2], [17, 40], [64], 2
    elif not torch.cuda.is_available():
        print("decode_attention_sweep needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2

    from atom.kernels.decode_attention import paged_decode_attention_reference

    configs = candidates(args.quick) if not smoke else candidates(True)[:3]
    paths = [*BASELINES, *configs]
    flush = None
    if args.cold and not smoke:
        scratch = torch.empty(128 << 20, dtype=torch.uint8, device=args.device)
        flush = scratch.zero_
    records = open(args.jsonl, "w") if args.jsonl else None  # noqa: SIM115
    started = time.perf_counter()
    chosen = {}
    for name in args.geometries:
        geometry = GEOMETRIES[name]
        max_context = max(args.contexts)
        layers = Layers(
            geometry, args.layers, max(args.batches), max_context, args.device,
            torch.float32 if smoke else torch.bfloat16,  # the interpreter's bf16 dots are off
        )  # fmt: skip
        flush_us = 0.0
        if flush is not None:
            flush_us = graph_us([lambda: None] * args.layers, args.repeats, flush)
        times: dict[tuple, dict[str, float]] = {}
        for batch in args.batches:
            for max_model_len in args.max_model_len:
                for context in args.contexts:
                    if context > max_model_len:
                        continue
                    q, tables, lens = layers.inputs(batch, context, max_model_len)
                    expected = paged_decode_attention_reference(
                        q, layers.k[0], layers.v[0], tables, lens, layers.head_dim**-0.5
                    ).float()
                    per_path = times[batch, max_model_len, context] = {}
                    for path in paths:
                        for out in layers.out:
                            out.fill_(float("nan"))  # a path must write its own output
                        calls = path_calls(layers, path, q, tables, lens)
                        if smoke:
                            begin = time.perf_counter()
                            for call in calls:
                                call()
                            us = (time.perf_counter() - begin) * 1e6 / len(calls)
                        else:
                            us = graph_us(calls, args.repeats, flush) - flush_us
                        out = layers.out[0][:batch].float()
                        max_err = (out - expected).abs().max().item()
                        us = max(us, 1e-3)  # --cold subtracts the flush: never <= 0
                        per_path[label(path)] = us
                        record = dict(
                            case="decode_sweep",
                            geometry=name,
                            batch=batch,
                            max_model_len=max_model_len,
                            context=context,
                            path=label(path),
                            us=round(us, 3),
                            max_err=round(max_err, 5),
                            ok=max_err < 0.05,
                        )
                        if records is not None:
                            records.write(json.dumps(record) + "\n")
                        if not record["ok"]:
                            emit(**record)  # a wrong output: on stdout too
        chosen[geometry] = summarize(name, geometry, times, configs)
    print("\n--- paste into atom/kernels/decode_attention_short.py")
    print(config_table(chosen))
    print("--- end paste")
    if records is not None:
        records.close()
    emit(case="decode_sweep_done", seconds=round(time.perf_counter() - started, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Batch-1 decode variants against the engine's defaults, in one process (issue 17).

    python -m benchmarks.decode_ab --shape llama-3.2-1b --variants default pdl_small default
    python -m benchmarks.decode_ab --shape smollm2-135m --variants default split_4_tiles

One engine per run (the shape of benchmarks/decode_profile.py: random bf16 weights,
CUDA graphs of batch 1, a 128-token prompt, a block table 784 tokens wide as the
--ablate run's). Each variant changes one choice of the kernels (a tile table entry, the
decode split policy, a fusion switch), captures the decode graph again and is measured as
``decode_profile.measure`` does (wall ms per step, torch.profiler kernels and GPU us per
step), plus ``graph_replay_us``: one replay of the captured batch-1 graph, timed by CUDA
events over 200 back-to-back replays (the device time of the graph alone, gaps between its
kernels included, none of the host's work). Speed-ups are against the mean of the variants
named ``default`` in the run (list it first and last: the drift of the machine).

Variants:
    default               the engine as configured (atom/fusions.py; the GEMV policy of
                          atom/kernels/gemv_policy.py measures each layer shape)
    gemv_fused            every batch-1 linear layer that fits runs the Triton GEMV (its
                          heuristic tile: ATOM_GEMV_POLICY=fused); gemv_unfused: none does
    split_4_tiles         decode attention splits of >= 4 tiles (the earlier policy)
    splits<N>             N context splits at batch 1 (N in 1, 2, 4, 8, 13, 16, 32)
    dec_w<W>s<S>          paged decode with W warps and S pipeline stages
                          (decode_attention.NUM_WARPS / NUM_STAGES; e.g. dec_w2s3)
    dec_cap<N>            paged decode split cap N (decode_attention.MAX_SPLITS; a power of 2)
    dec_occ<N>            paged decode splits aiming at N programs per SM (PROGRAMS_PER_SM)
    dec_skip              empty splits store nothing, the merge reads only the filled ones
    a+b                   both (e.g. pdl_late+splits8)
    pdl                   Fusions.pdl on (the default): the small kernels and the
                          latency-bound GEMVs (atom/kernels/pdl.py); pdl_all: every GEMV too; pdl_small: no
                          GEMV; pdl_late: GEMVs release the next kernel after their K loop;
                          no_pdl: Fusions.pdl off; no_early_kv: under PDL paged decode
                          loads no K / V before its wait (only the block ids)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import types
from contextlib import contextmanager

import torch

from atom.fusions import Fusions
from atom.kernels import decode_attention, gemv_policy, pdl
from benchmarks import decode_profile, harness
from benchmarks.model_shapes import MATRIX, hf_config


def _apply(name: str, pick) -> None:
    """One variant's change (see the module docstring); `pick`: the split policy's own."""
    if name in ("gemv_fused", "gemv_unfused"):
        gemv_policy.set_policy(gemv_policy.GemvPolicy(name.removeprefix("gemv_")))
    elif name == "split_4_tiles":
        decode_attention._pick_num_splits = lambda q, kv, ctx, _, *cap: pick(
            q, kv, ctx, 4 * 64, *cap
        )
    elif name.startswith("splits"):
        n = int(name.removeprefix("splits"))
        decode_attention._pick_num_splits = lambda q, kv, ctx, tokens, *cap: (
            n if q.shape[0] == 1 else pick(q, kv, ctx, tokens, *cap)
        )
    elif name.startswith("dec_cap"):
        decode_attention.MAX_SPLITS = int(name.removeprefix("dec_cap"))
    elif name == "dec_skip":
        decode_attention.SKIP_EMPTY_SPLITS = True
    elif name.startswith("dec_occ"):
        decode_attention.PROGRAMS_PER_SM = int(name.removeprefix("dec_occ"))
    elif name.startswith("dec_w"):
        warps, stages = name.removeprefix("dec_w").split("s")
        decode_attention.NUM_WARPS, decode_attention.NUM_STAGES = int(warps), int(stages)
    elif name == "no_early_kv":
        decode_attention.PDL_EARLY_KV = False
    elif name.startswith("pdl_mb"):
        pdl.PDL_GEMV_BYTES = int(name.removeprefix("pdl_mb")) << 20
    elif name not in ("default", "pdl", "pdl_small", "pdl_all", "pdl_late", "no_pdl"):
        raise SystemExit(f"unknown variant {name!r} (see the module docstring)")


@contextmanager
def variant(name: str):
    """Apply variant `name` (the GEMV policy, the split policy, early K / V) for its
    block; `a+b` applies both. The fusions and PDL knobs are `fusions_of(name)`."""
    policy = gemv_policy.current_policy()
    pick = decode_attention._pick_num_splits
    early_kv = decode_attention.PDL_EARLY_KV
    gemv_bytes = pdl.PDL_GEMV_BYTES
    launch = (decode_attention.MAX_SPLITS, decode_attention.NUM_WARPS,
              decode_attention.NUM_STAGES, decode_attention.PROGRAMS_PER_SM,
              decode_attention.SKIP_EMPTY_SPLITS)  # fmt: skip
    try:
        for part in name.split("+"):
            _apply(part, pick)
        yield
    finally:
        gemv_policy.set_policy(policy)
        decode_attention._pick_num_splits = pick
        decode_attention.PDL_EARLY_KV = early_kv
        pdl.PDL_GEMV_BYTES = gemv_bytes
        (decode_attention.MAX_SPLITS, decode_attention.NUM_WARPS,
         decode_attention.NUM_STAGES, decode_attention.PROGRAMS_PER_SM,
         decode_attention.SKIP_EMPTY_SPLITS) = launch  # fmt: skip


def fusions_of(name: str) -> Fusions:
    """The engine's fusions with variant `name`'s switches and PDL knobs."""
    fusions = Fusions.from_env()
    knobs = dict(pdl_small=("pdl_kernels", "small"), pdl_all=("pdl_kernels", "all"),
                 pdl_late=("pdl_release", "end"))  # fmt: skip
    for part in name.split("+"):
        if part.startswith("pdl"):
            fusions = dataclasses.replace(fusions, pdl=True)
        if part in knobs:
            field, value = knobs[part]
            fusions = dataclasses.replace(fusions, **{field: value})
        if part == "no_pdl":
            fusions = dataclasses.replace(fusions, pdl=False)
    return fusions


def graph_replay_us(llm, replays: int = 200) -> float:
    """Device us of one replay of the batch-1 decode graph (back to back, CUDA events)."""
    graph = llm.engine.model_runner.graphs[0].graphs[1]
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(MATRIX), required=True)
    parser.add_argument("--variants", nargs="+", default=["default", "default"])
    parser.add_argument("--prompt-len", type=int, default=128,
                        help="the batch-1 prompt (context) length; the block table is "
                             "this + 656 tokens wide (784 at the default)")  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    shape = f"{args.shape}-shape"
    run = types.SimpleNamespace(input_len=args.prompt_len + 384, output_len=256,
                                batch1_input_len=args.prompt_len,
                                batch1_output_len=256, window_steps=64, profile_steps=30,
                                top_kernels=6)  # fmt: skip
    bandwidth = harness.streaming_bandwidth()
    torch.cuda.empty_cache()
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        hf_config(args.shape).save_pretrained(model_dir)
        llm = decode_profile.build_engine(model_dir, run, Fusions.from_env())
        for name in args.variants:
            with variant(name):
                record = decode_profile.measure(llm, shape, fusions_of(name), run, bandwidth)
                record["graph_replay_us"] = round(graph_replay_us(llm), 1)
            record["variant"] = name
            rows.append(record)
            print(json.dumps(record), flush=True)
        llm.engine.shutdown()
    defaults = [r["decode_ms_per_step"] for r in rows if r["variant"] == "default"]
    base = sum(defaults) / len(defaults) if defaults else None
    print(f"\n{shape}, batch 1: tok/s (wall), ms/step, speed-up, GPU us (kernel sum), "
          "graph replay us, kernels/step", file=sys.stderr)  # fmt: skip
    for r in rows:
        speedup = f"{base / r['decode_ms_per_step']:7.3f}" if base else "      -"
        print(f"{r['variant']:<20}{r['decode_tok_s']:>8.0f}{r['decode_ms_per_step']:>8.3f}"
              f"{speedup}{r['gpu_us_per_step']:>8.1f}{r['graph_replay_us']:>8.1f}"
              f"{r['kernels_per_step']:>7.1f}", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

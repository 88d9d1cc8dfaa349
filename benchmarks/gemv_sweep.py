"""`python3 -m benchmarks.gemv_sweep`: the batch-1 Triton GEMV against cuBLAS, per layer.

For every batch-1 linear layer of the Llama-3.2-1B and SmolLM2-135M shapes (bf16, one
token) this times the unfused path the engine runs today (cuBLAS ``F.linear`` plus atom's
separate ``rms_norm`` / ``silu_and_mul`` kernels: what a fusion replaces) against the
one-row Triton GEMV (atom/kernels/gemv.py ``_gemv_row_kernel``) over a grid of launch
geometries, and prints the best geometry per layer as a GEMV_CONFIGS dict (a diagnostic:
the engine measures its own tiles and choices, atom/kernels/gemv_policy.py; a geometry that
wins here can join that module's `candidates`). GPU only, one process, about 2-3 minutes on
an H200
(``--budget-s`` bounds it: once spent, the refinement stages are skipped).

Layers (`layer`), each keyed as in GEMV_CONFIGS by (in_features, weight rows, silu_mul,
norm, single_row):
    qkv                 F.linear                              vs gemv
    qkv+norm            rms_norm(+residual) + F.linear        vs gemv_rms_norm
    o, down, lm_head    F.linear                              vs gemv
    gate_up+silu        F.linear + silu_and_mul               vs gemv_silu_and_mul
    gate_up+silu+norm   rms_norm(+residual) + F.linear + silu vs gemv_rms_norm(silu_mul)
(No residual epilogue for o / down: the residual add already lives in the next RMSNorm
kernel, or in the next GEMV's prologue with norm_gemv, so it would cut no kernel.)

Timing: each measurement captures ``--calls`` calls back to back in one CUDA graph (more
when the rotation needs it) and replays it ``--replays`` times between CUDA events; the
per-call time is the median replay over the calls, so it includes the in-graph launch gap
as in the engine's decode graph. The calls rotate over copies of the weight whose total
(>= 150 MB) exceeds the 50 MB L2, so no call finds its weight in L2 (x and the residual
stay there, as in the engine).

Search: stage 1 sweeps BLOCK_N in 1..16, BLOCK_K in 128..2048 and 1..8 warps, keeping the
geometries with 8..64 weight elements per thread and tile, each with 1 stage (loads into
registers) and 2 (cp.async through shared memory) where the K loop has several chunks;
the norm layers try the 4 best geometries of their layer without the norm (and the same
tile with 2x and 4x BLOCK_N: the prologue's x reads are per program); stage 2 tries 3 and 4
stages for the 3 best of each layer, while the budget lasts. Each phase's geometries are
compiled ahead in a thread pool (Triton's AsyncCompileMode, where this Triton has it).

Output, one JSON line each: `stream_bandwidth` (a 4 GiB streaming read and copy, as
decode_profile measures it); per layer and candidate `measurement` (`config` = [BLOCK_N,
BLOCK_K, warps, stages], "baseline" or "heuristic": gemv_config's choice today; `us`,
`weight_gb_s`, `of_stream_read`, `speedup` = baseline us / this us, > 1 is faster than
the unfused path); `summary` per layer (the best geometry, its speed-up, bandwidth and
fraction of the streaming read); `model_summary` per model (per-token sum over its
layers, the unfused path against the best Triton layers: whether the fusion switches can
win); `config_table` (the dict); then, as plain text, the GEMV_CONFIGS block to paste.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atom.kernels.activation import silu_and_mul
from atom.kernels.gemv import (
    GemvConfig,
    compile_row_kernel,
    gemv,
    gemv_rms_norm,
    gemv_silu_and_mul,
)
from atom.kernels.gemv_trial import cuda_seconds_per_call
from atom.kernels.rmsnorm import rms_norm
from benchmarks.harness import emit

BLOCK_NS = (1, 2, 4, 8, 16)
BLOCK_KS = (128, 256, 512, 1024, 2048, 4096, 8192)  # the wide ones: K > 2048 only
WARPS = (1, 2, 4, 8)
L2_BYTES = 50 << 20
ROTATION_BYTES = 3 * L2_BYTES  # the weight copies one graph rotates over
EPS = 1e-5
TOLERANCE = 2e-2  # atol = rtol against the unfused path's output (tests/kernels/test_gemv.py)


@dataclass(frozen=True)
class Layer:
    """One batch-1 linear layer of a model: a weight [rows, in_features] (rows = 2 *
    intermediate with the SiLU epilogue), with or without the norm prologue."""

    model: str
    name: str
    in_features: int
    rows: int
    silu_mul: bool
    norm: bool
    per_token: int  # how many times a decode step runs it

    @property
    def key(self) -> tuple[int, int, bool, bool, bool]:
        return (self.in_features, self.rows, self.silu_mul, self.norm, True)

    @property
    def weight_bytes(self) -> int:
        return self.in_features * self.rows * 2  # bf16

    @property
    def plain_name(self) -> str:
        """The same layer without the norm prologue (whose best geometries it tries)."""
        return self.name.removesuffix("+norm")


def model_layers(model: str, config: dict) -> list[Layer]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    n = config["num_hidden_layers"]
    return [
        Layer(model, "qkv", hidden, q + 2 * kv, False, False, n),
        Layer(model, "qkv+norm", hidden, q + 2 * kv, False, True, n),
        Layer(model, "o", q, hidden, False, False, n),
        Layer(model, "gate_up+silu", hidden, 2 * inter, True, False, n),
        Layer(model, "gate_up+silu+norm", hidden, 2 * inter, True, True, n),
        Layer(model, "down", inter, hidden, False, False, n),
        Layer(model, "lm_head", hidden, config["vocab_size"], False, False, 1),
    ]


def default_models() -> dict[str, dict]:
    from benchmarks.decode_profile import SMOLLM2_135M
    from benchmarks.offline_throughput import LLAMA_32_1B

    return {"llama-3.2-1b": LLAMA_32_1B, "smollm2-135m": SMOLLM2_135M}


def tile_grid(layer: Layer) -> list[GemvConfig]:
    """Stage 1: every (BLOCK_N, BLOCK_K, warps) with 8..64 weight elements per thread and
    tile, BLOCK_K no wider than in_features' power of two, BLOCK_N no more than the rows;
    1 and 2 stages where the K loop has several chunks."""
    out_rows = layer.rows // 2 if layer.silu_mul else layer.rows
    widest = 1 << math.ceil(math.log2(layer.in_features))
    grid = []
    for block_n in BLOCK_NS:
        for block_k in BLOCK_KS:
            for warps in WARPS:
                per_thread = block_n * block_k // (32 * warps)
                if 8 <= per_thread <= 64 and block_k <= max(widest, 128) and block_n <= out_rows:
                    # loads from registers (1 stage) or pipelined through shared memory
                    for stages in (1, 2) if layer.in_features > block_k else (1,):
                        grid.append(GemvConfig(block_n, block_k, warps, stages))
    return grid


class Inputs:
    """x, the residual, the norm weight and the rotating weight copies of one layer."""

    def __init__(self, layer: Layer, device: str, rotation_bytes: int, dtype: torch.dtype):
        k = layer.in_features
        generator = torch.Generator(device).manual_seed(0)
        self.x = torch.randn(1, k, device=device, dtype=dtype, generator=generator)
        self.residual = torch.randn(1, k, device=device, dtype=dtype, generator=generator)
        self.norm_weight = torch.ones(k, device=device, dtype=dtype)
        first = torch.randn(layer.rows, k, device=device, dtype=dtype, generator=generator)
        first /= k**0.5
        copies = max(2, -(-rotation_bytes // layer.weight_bytes))
        self.weights = [first] + [first.clone() for _ in range(copies - 1)]


def baseline_call(layer: Layer, inputs: Inputs) -> Callable[[torch.Tensor], object]:
    """The unfused path the engine runs today for this layer (cuBLAS and atom's kernels)."""
    x, residual, norm_weight = inputs.x, inputs.residual, inputs.norm_weight

    def run(weight):
        h = rms_norm(x, norm_weight, EPS, residual)[0] if layer.norm else x
        out = F.linear(h, weight)
        return silu_and_mul(out) if layer.silu_mul else out

    return run


def triton_call(layer: Layer, inputs: Inputs, config: GemvConfig | None):
    """The fused one-row Triton GEMV with `config` (None: gemv_config's own choice)."""
    x, residual, norm_weight = inputs.x, inputs.residual, inputs.norm_weight
    if layer.norm:
        return lambda w: gemv_rms_norm(x, residual, norm_weight, EPS, w, layer.silu_mul, config)
    if layer.silu_mul:
        return lambda w: gemv_silu_and_mul(x, w, config)
    return lambda w: gemv(x, w, config)


def seconds_per_call(run, weights: list, calls: int, replays: int) -> float:
    """Median over replays of one CUDA graph of `calls` calls rotating over `weights`
    (wall time of direct calls on CPU)."""
    calls = max(calls, len(weights))
    run(weights[0])  # compile / warm up outside the graph
    if not weights[0].is_cuda:
        start = time.perf_counter()
        for i in range(calls):
            run(weights[i % len(weights)])
        return (time.perf_counter() - start) / calls
    return cuda_seconds_per_call(run, weights, calls, replays)


class Sweep:
    """Measurements of every layer, each emitted as it is taken."""

    def __init__(self, args, stream_read: float | None, device: str):
        self.args, self.stream_read, self.device = args, stream_read, device
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's
        self.results: dict[tuple[str, str], dict] = {}  # (model, layer) -> its record
        self.started = time.perf_counter()

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.args.budget_s

    def measure(self, layer: Layer, candidates: list[GemvConfig | None | str]) -> None:
        """Time each candidate (a GemvConfig, None = the heuristic, "baseline")."""
        record = self.results.setdefault(
            (layer.model, layer.name), dict(layer=layer, baseline_us=None, configs={})
        )
        inputs = Inputs(layer, self.device, self.args.rotation_bytes, self.dtype)
        expected = _first(baseline_call(layer, inputs)(inputs.weights[0])).float()
        for candidate in candidates:
            label = candidate if isinstance(candidate, str) else _label(candidate)
            if label in record["configs"] or (label == "baseline" and record["baseline_us"]):
                continue
            if candidate == "baseline":
                run = baseline_call(layer, inputs)
            else:
                run = triton_call(layer, inputs, candidate)
            try:
                us = 1e6 * seconds_per_call(run, inputs.weights, self.args.calls, self.args.replays)
            except Exception as error:  # e.g. out of shared memory: record it, go on
                where = _where(layer)
                emit(dict(case="measurement", **where, config=label, error=repr(error)[:200]))
                continue
            figures = self._figures(layer, us, record)
            if candidate == "baseline":
                record["baseline_us"] = us
            else:  # a geometry that computes something else never wins
                diff = (_first(run(inputs.weights[0])).float() - expected).abs()
                matches = bool((diff <= TOLERANCE * (1 + expected.abs())).all())
                figures.update(max_abs_diff=round(diff.max().item(), 5), matches=matches)
                if matches:
                    record["configs"][label] = us
            emit(dict(case="measurement", **_where(layer), config=label, **figures))
        del inputs
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def _figures(self, layer: Layer, us: float, record: dict) -> dict:
        gb_s = layer.weight_bytes / us / 1e3
        base = record["baseline_us"]
        return dict(
            us=round(us, 3),
            weight_gb_s=round(gb_s, 1),
            of_stream_read=round(gb_s * 1e9 / self.stream_read, 3) if self.stream_read else None,
            speedup=round(base / us, 3) if base else None,
        )

    def best(self, layer: Layer, count: int) -> list[GemvConfig]:
        configs = self.results[(layer.model, layer.name)]["configs"]
        ranked = sorted((us, label) for label, us in configs.items() if label != "heuristic")
        return [GemvConfig(*label) for _, label in ranked[:count]]


def _first(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def _rounded(us: float | None):
    return None if us is None else round(us, 3)


def _label(config: GemvConfig | None):
    if config is None:
        return "heuristic"
    return (config.block_n, config.block_k, config.num_warps, config.num_stages)


def _where(layer: Layer) -> dict:
    return dict(model=layer.model, layer=layer.name, in_features=layer.in_features,
                rows=layer.rows)  # fmt: skip


def _measured_best(sweep: Sweep, layer: Layer) -> list[GemvConfig]:
    return sweep.best(layer, 4) if (layer.model, layer.name) in sweep.results else []


def norm_candidates(sweep: Sweep, layer: Layer, plain: Layer) -> list[GemvConfig]:
    """The 4 best geometries without the norm, and each with 2x and 4x BLOCK_N over a BLOCK_K
    as much narrower (the same tile: fewer programs, so fewer per-program reads of x for
    the RMS)."""
    out = []
    for config in sweep.best(plain, 4):
        for factor in (1, 2, 4):
            block_n, block_k = config.block_n * factor, max(128, config.block_k // factor)
            if block_n > 16:
                continue
            if layer.in_features <= block_k:
                stages = 1  # one chunk: nothing to pipeline
            elif layer.in_features > config.block_k:
                stages = config.num_stages  # the K loop was a loop already
            else:
                stages = 2
            out.append(GemvConfig(block_n, block_k, config.num_warps, stages))
    return list(dict.fromkeys(out))


def stage_candidates(sweep: Sweep, layer: Layer) -> list[GemvConfig]:
    """Stage 2: 3 and 4 stages (deeper cp.async pipelines) for the 3 best geometries whose K
    loop has several chunks."""
    out = []
    for config in sweep.best(layer, 3):
        if layer.in_features > config.block_k:
            for stages in (3, 4):
                out.append(GemvConfig(config.block_n, config.block_k, config.num_warps, stages))
    return out


def precompile(jobs: list[tuple[Layer, GemvConfig]]) -> None:
    """Compile the (layer, geometry) pairs in a thread pool through Triton's
    AsyncCompileMode where this Triton has it (compiling dominates the sweep: ~300 variants);
    else they compile one by one at their first call. Errors surface at that call."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        emit(dict(case="precompile", skipped="this Triton has no AsyncCompileMode"))
        return
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            with AsyncCompileMode(pool, ignore_errors=True):
                for layer, config in jobs:
                    out_features = layer.rows // 2 if layer.silu_mul else layer.rows
                    compile_row_kernel(layer.in_features, out_features, layer.silu_mul,
                                       layer.norm, layer.norm, config)  # fmt: skip
    except Exception as error:  # an older Triton's API: compile at the first call instead
        emit(dict(case="precompile", error=repr(error)[:200]))
        return
    seconds = round(time.perf_counter() - start, 1)
    emit(dict(case="precompile", jobs=len(jobs), seconds=seconds))


def run_sweep(args, models: dict[str, dict], device: str, grid=None) -> dict:
    """Measure every layer of `models`; returns the config table. `grid` (a list of
    GemvConfig) replaces the search (the CPU smoke test)."""
    stream_read = None
    if device == "cuda":
        from benchmarks.harness import streaming_bandwidth

        bandwidth = streaming_bandwidth()
        torch.cuda.empty_cache()
        stream_read = bandwidth["stream_read"]
        emit(dict(case="stream_bandwidth", read_tb_s=round(stream_read / 1e12, 3),
                  copy_tb_s=round(bandwidth["stream_copy"] / 1e12, 3),
                  gpu=torch.cuda.get_device_name()))  # fmt: skip
    sweep = Sweep(args, stream_read, device)
    layers = [layer for model, config in models.items() for layer in model_layers(model, config)]
    if args.layers:
        layers = [layer for layer in layers if layer.name in args.layers]
    by_name = {(layer.model, layer.name): layer for layer in layers}
    plain = [layer for layer in layers if not layer.norm]
    # stage 1: the grid (or the given geometries) for the layers without the norm
    run_phase(sweep, [(layer, grid or tile_grid(layer)) for layer in plain], plain)
    plan = []  # the norm layers: from their sibling's best (the whole grid without one)
    for layer in (layer for layer in layers if layer.norm):
        sibling = by_name.get((layer.model, layer.plain_name))
        if grid is not None:
            plan.append((layer, grid))
        elif sibling is None:
            plan.append((layer, tile_grid(layer)))
        else:
            plan.append((layer, norm_candidates(sweep, layer, sibling)))
    run_phase(sweep, plan, plain)
    if grid is None:  # stage 2: the pipelining depth of the best, while the budget lasts
        if sweep.over_budget():
            emit(dict(case="budget_spent", skipped="stage 2",
                      seconds=round(time.perf_counter() - sweep.started)))  # fmt: skip
        else:
            run_phase(sweep, [(layer, stage_candidates(sweep, layer)) for layer in layers], [])
    return summarize(sweep, layers, models)


def run_phase(sweep: Sweep, plan: list[tuple[Layer, list[GemvConfig]]], fallback) -> None:
    """Measure each layer's baseline, the heuristic and its candidates, compiled ahead in
    parallel. Past the budget a layer tries only the best geometries of the `fallback`
    layers measured so far (compiled already) instead of its candidates."""
    if sweep.device == "cuda" and not sweep.args.no_precompile:
        precompile([(layer, config) for layer, configs in plan for config in configs])
    for layer, candidates in plan:
        if sweep.over_budget() and fallback:
            candidates = [c for other in fallback for c in _measured_best(sweep, other)]
        sweep.measure(layer, ["baseline", None, *candidates])


def summarize(sweep: Sweep, layers: list[Layer], models: dict[str, dict]) -> dict:
    table, notes, slower = {}, {}, set()
    step = {model: dict(baseline_us=0.0, best_triton_us=0.0) for model in models}
    for layer in layers:
        record = sweep.results.get((layer.model, layer.name))
        if not record or not record["configs"] or not record["baseline_us"]:
            continue
        label, us = min(
            ((label, us) for label, us in record["configs"].items() if label != "heuristic"),
            key=lambda item: item[1],
            default=("heuristic", record["configs"].get("heuristic")),
        )
        figures = sweep._figures(layer, us, record)
        emit(dict(case="summary", **_where(layer), key=list(layer.key), best_config=label,
                  baseline_us=round(record["baseline_us"], 3),
                  heuristic_us=_rounded(record["configs"].get("heuristic")),
                  **{f"best_{k}": v for k, v in figures.items()}))  # fmt: skip
        if label != "heuristic":
            table[layer.key] = tuple(label)
            notes[layer.key] = f"{layer.model} {layer.name}: {figures['speedup']}x unfused"
            if figures["speedup"] < 1:  # the engine keeps the unfused path for this shape
                slower.add(layer.key)
        # a step runs qkv and gate_up either with or without the norm: count the norm ones
        if layer.name not in ("qkv", "gate_up+silu"):
            step[layer.model]["baseline_us"] += layer.per_token * record["baseline_us"]
            step[layer.model]["best_triton_us"] += layer.per_token * us
    for model, totals in step.items():
        if totals["best_triton_us"]:
            emit(dict(case="model_summary", model=model,
                      layers="qkv+norm, o, gate_up+silu+norm, down per layer, lm_head",
                      baseline_us_per_token=round(totals["baseline_us"], 1),
                      best_triton_us_per_token=round(totals["best_triton_us"], 1),
                      speedup=round(totals["baseline_us"] / totals["best_triton_us"], 3)))  # fmt: skip
    emit(dict(case="config_table", GEMV_CONFIGS={str(k): list(v) for k, v in table.items()}))
    print(paste_block(table, notes, slower), flush=True)
    return table


def paste_block(table: dict, notes: dict, slower: set = frozenset()) -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    lines = [
        f"# the best tiles (gemv_sweep, {gpu}, {time.strftime('%Y-%m-%d')})",
        "GEMV_CONFIGS: dict[tuple[int, int, bool, bool, bool], tuple[int, int, int, int]] = {",
    ]
    for key, value in table.items():
        lines.append(f"    {key}: {value},  # {notes[key]}")
    lines.append("}")
    lines.append("# the shapes whose best Triton GEMV lost to the unfused cuBLAS path")
    lines.append("GEMV_SLOWER: set[tuple[int, int, bool, bool, bool]] = {")
    lines.extend(f"    {key},  # {notes[key]}" for key in sorted(slower))
    lines.append("}")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=None, help="llama-3.2-1b smollm2-135m")
    parser.add_argument("--layers", nargs="*", default=None, help="e.g. qkv down lm_head")
    parser.add_argument("--calls", type=int, default=50, help="calls per CUDA graph (at least)")
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=180.0,
                        help="after this many seconds the stage-2 refinement is skipped")  # fmt: skip
    parser.add_argument("--rotation-bytes", type=int, default=ROTATION_BYTES)
    parser.add_argument("--no-precompile", action="store_true",
                        help="compile each geometry at its first call, not ahead in threads")  # fmt: skip
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_sweep needs a CUDA GPU", file=sys.stderr)
        return 1
    models = default_models()
    if args.models:
        models = {name: models[name] for name in args.models}
    start = time.perf_counter()
    with torch.inference_mode():
        run_sweep(args, models, "cuda")
    print(f"# gemv_sweep took {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

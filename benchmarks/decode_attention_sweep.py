"""`python3 -m benchmarks.decode_attention_sweep`: paged decode attention's launch knobs.

Times paged decode attention (atom/kernels/decode_attention.py: ``_paged_decode_kernel``
and, when the context is split, ``_merge_splits_kernel``) at batch 1 (and batch 8, a sanity
check) for the Llama-3.2-1B (32 q heads, 8 kv heads, head_dim 64) and SmolLM2-135M (9 / 3
/ 64) shapes, bf16 cache, block size 16, contexts 128, 2048, 8192 and 16384 tokens, over a
grid of the kernel's keyword knobs: ``block_n`` (tokens per tile), ``num_warps``,
``num_stages``, ``max_splits`` (the split cap, the merge kernel's tile) and the options
``min_split_tokens`` / ``skip_empty_splits`` / ``single_split_direct``. The block table is
as wide as the engine builds it (``--max-model-len`` tokens, 16384 by default): the split
count is picked from that width as in the engine, whatever the context.

Search, per (shape, context) at batch 1 (each stage for every case before the next, so a
spent ``--budget-s`` skips refinement, never a case):
    1. num_warps x num_stages at the default tile and cap (and the default itself)
    2. block_n x max_splits at stage 1's best warps / stages
    3. min_split_tokens x {plain, skip (empty splits store nothing, the merge reads the
       lengths), skip+direct (split 0 alone: it writes out, the merge skips the row)} at
       the best so far
    4. batch 8: the default and the batch-1 winner of the same shape and context
Every config's output is checked against ``paged_decode_attention_reference`` (max abs
error; a mismatch is reported and never wins) before it is timed; a config that fails to
compile or launch is reported as an error and skipped.

Timing: ``--calls`` calls of decode(+merge) captured back to back in one CUDA graph (PDL
as the engine's defaults have it; ``--no-pdl``: off), replayed ``--replays`` times; the per-call time is the
median replay over the calls (the in-graph launch gaps included, as in the decode graph).
The calls rotate over block tables of disjoint, shuffled blocks whose KV totals >=
``--rotation-bytes`` (150 MB, three times the H200's L2), so no call finds its KV in L2,
as in the engine, where 16-30 layers' KV and the weights stream through between steps.

Output: one JSON line per measurement (`case` = measurement: `config`, `us`, `tb_s` = KV
bytes / time, `max_abs_err`, or `error`) and per case (`case` = summary); then a table on
stderr: per (shape, batch, context) the default's time, the best config and its time,
both as TB/s of KV read, and the time the best saves per decode step over the model's
layers. About 3-5 minutes on an H200 (``--quick``: a small grid, under a minute).

    python -m benchmarks.decode_attention_sweep [--quick] [--shapes llama-3.2-1b]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass

import torch

from atom.kernels import decode_attention
from atom.kernels.decode_attention import (
    MAX_SPLITS,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from benchmarks.harness import emit, graph_us

CONTEXTS = (128, 2048, 8192, 16384)
BATCHES = (1, 8)
WARPS = (2, 4, 8)
STAGES = (1, 2, 3, 4)
BLOCK_NS = (32, 64, 128)
CAPS = (16, 32, 64, 128)
MIN_SPLIT_TOKENS = (0, 128, 256, 512, 1024)
MODES = {"plain": (False, False), "skip": (True, False), "skip+direct": (True, True)}
QUICK = dict(warps=(4, 8), stages=(2, 3), block_ns=(64, 128), caps=(32, 64),
             min_split_tokens=(0, 256), modes=("plain", "skip+direct"))  # fmt: skip
TOLERANCE = 3e-2  # atol = rtol for bf16 (tests/kernels/test_decode_attention.py)
L2_BYTES = 50 << 20


@dataclass(frozen=True)
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int  # decode attention calls per step


SHAPES = {
    "llama-3.2-1b": Shape(32, 8, 64, 16),
    "smollm2-135m": Shape(9, 3, 64, 30),
}


@dataclass(frozen=True)
class Config:
    """paged_decode_attention's launch knobs; the defaults are the engine's."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    max_splits: int = MAX_SPLITS
    min_split_tokens: int = 0
    skip_empty_splits: bool = False
    single_split_direct: bool = False

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def label(self) -> str:
        if self == Config():
            return "default"
        mode = [m for m, flags in MODES.items() if flags == self._flags()]
        mode = mode[0] if mode else "direct"
        return (f"bn{self.block_n or 'D'} w{self.num_warps or 'D'} s{self.num_stages or 'D'} "
                f"cap{self.max_splits} min{self.min_split_tokens} {mode}")  # fmt: skip

    def _flags(self) -> tuple[bool, bool]:
        return (self.skip_empty_splits, self.single_split_direct)


class Case:
    """The tensors of one (shape, batch, context): q, a bf16 paged cache of shuffled blocks,
    ``rotations`` block tables over disjoint blocks, the reference output of the first."""

    def __init__(self, name: str, shape: Shape, batch: int, context: int, args, device: str):
        self.name, self.shape, self.batch, self.context = name, shape, batch, context
        dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's
        block_size = args.block_size
        width = -(-max(args.max_model_len, context) // block_size)  # the engine's table
        context_blocks = -(-context // block_size)
        self.kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim * dtype.itemsize
        rotations = max(1, min(args.max_rotations, -(-args.rotation_bytes // self.kv_bytes)))
        generator = torch.Generator(device).manual_seed(0)
        num_blocks = rotations * batch * context_blocks
        cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        self.k_cache = torch.randn(cache_shape, device=device, dtype=dtype, generator=generator)
        self.v_cache = torch.randn(cache_shape, device=device, dtype=dtype, generator=generator)
        ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
        ids = ids.to(device, torch.int32).view(rotations, batch, context_blocks)
        self.tables = []
        for rotation in range(rotations):
            table = torch.zeros(batch, width, device=device, dtype=torch.int32)
            table[:, :context_blocks] = ids[rotation]
            self.tables.append(table)
        self.q = torch.randn(batch, shape.num_q_heads, shape.head_dim, device=device,
                             dtype=dtype, generator=generator)  # fmt: skip
        self.lens = torch.full((batch,), context, device=device, dtype=torch.int32)
        self.out = torch.empty_like(self.q)
        self.scale = shape.head_dim**-0.5
        self.expected = paged_decode_attention_reference(
            self.q, self.k_cache, self.v_cache, self.tables[0], self.lens, self.scale
        ).float()

    def call(self, config: Config, rotation: int = 0) -> None:
        paged_decode_attention(self.q, self.k_cache, self.v_cache, self.tables[rotation],
                               self.lens, self.scale, self.out, **config.kwargs())  # fmt: skip

    def where(self) -> dict:
        return dict(shape=self.name, batch=self.batch, context=self.context)

    def num_splits(self, config: Config) -> int:
        """The split count the wrapper picks for ``config`` (from the table's width)."""
        block_n = config.block_n or (64 if self.q.is_cuda else 256)
        width = self.tables[0].shape[1] * self.k_cache.shape[1]
        return decode_attention._pick_num_splits(
            self.q, self.shape.num_kv_heads, width, block_n, config.max_splits
        )


def seconds_per_call(case: Case, config: Config, calls: int, replays: int) -> float:
    """Median over replays of one CUDA graph of ``calls`` calls rotating over the case's
    block tables (wall time of direct calls on CPU)."""
    rotations = len(case.tables)
    calls = max(calls, rotations)

    def body():
        for i in range(calls):
            case.call(config, i % rotations)

    if not case.q.is_cuda:
        start = time.perf_counter()
        body()
        return (time.perf_counter() - start) / calls
    return graph_us(body, replays) / calls / 1e6


class Sweep:
    """Measurements of every case, each emitted as it is taken."""

    def __init__(self, args, device: str):
        self.args, self.device = args, device
        self.results: dict[tuple[str, int, int], dict[Config, float]] = {}
        self.started = time.perf_counter()

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.args.budget_s

    def measure(self, name: str, batch: int, context: int, configs: list[Config]) -> None:
        key = (name, batch, context)
        record = self.results.setdefault(key, {})
        todo = [config for config in dict.fromkeys(configs) if config not in record]
        if not todo:
            return
        case = Case(name, self.args.shapes_table[name], batch, context, self.args, self.device)
        for config in todo:
            where = dict(case="measurement", **case.where(), config=config.label)
            try:
                case.out.fill_(float("nan"))
                case.call(config)
                if case.q.is_cuda:
                    torch.cuda.synchronize()
            except Exception as error:  # e.g. out of shared memory: record it, go on
                emit(dict(where, error=repr(error)[:300]))
                record[config] = math.inf
                continue
            diff = (case.out.float() - case.expected).abs()
            max_error = diff.max().item()
            matches = bool((diff <= TOLERANCE * (1 + case.expected.abs())).all())
            if not matches:  # NaN included: a config that computes something else never wins
                emit(dict(where, max_abs_err=max_error, matches=False))
                record[config] = math.inf
                continue
            try:
                seconds = seconds_per_call(case, config, self.args.calls, self.args.replays)
            except Exception as error:  # the capture failed: record it, go on
                emit(dict(where, error="timing: " + repr(error)[:300]))
                record[config] = math.inf
                continue
            record[config] = seconds * 1e6
            emit(dict(where, us=round(seconds * 1e6, 3),
                      tb_s=round(case.kv_bytes / seconds / 1e12, 3),
                      max_abs_err=round(max_error, 5), num_splits=case.num_splits(config),
                      rotations=len(case.tables)))  # fmt: skip
        del case
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def best(self, name: str, batch: int, context: int) -> Config:
        record = self.results.get((name, batch, context), {})
        finite = {config: us for config, us in record.items() if math.isfinite(us)}
        return min(finite, key=finite.get) if finite else Config()


def grids(args) -> dict:
    quick = args.quick
    return dict(
        warps=QUICK["warps"] if quick else WARPS,
        stages=QUICK["stages"] if quick else STAGES,
        block_ns=QUICK["block_ns"] if quick else BLOCK_NS,
        caps=QUICK["caps"] if quick else CAPS,
        min_split_tokens=QUICK["min_split_tokens"] if quick else MIN_SPLIT_TOKENS,
        modes=QUICK["modes"] if quick else tuple(MODES),
    )


def warps_stages(grid: dict) -> list[Config]:
    """Stage 1: every num_warps x num_stages at the default tile and cap."""
    return [Config()] + [Config(num_warps=w, num_stages=s)
                         for w in grid["warps"] for s in grid["stages"]]  # fmt: skip


def tiles_caps(grid: dict, best: Config) -> list[Config]:
    """Stage 2: every block_n x split cap at the best warps / stages."""
    return [dataclasses.replace(best, block_n=n, max_splits=cap)
            for n in grid["block_ns"] for cap in grid["caps"]]  # fmt: skip


def split_options(grid: dict, best: Config) -> list[Config]:
    """Stage 3: every least split share x mode (plain, skip, skip+direct) at the best."""
    out = []
    for tokens in grid["min_split_tokens"]:
        for mode in grid["modes"]:
            skip, direct = MODES[mode]
            out.append(dataclasses.replace(best, min_split_tokens=tokens,
                                           skip_empty_splits=skip, single_split_direct=direct))  # fmt: skip
    return out


def run_sweep(args, device: str) -> Sweep:
    sweep = Sweep(args, device)
    grid = grids(args)
    cases = [(name, context) for name in args.shapes_table for context in args.contexts]
    batch1 = [b for b in args.batches if b == 1] or args.batches[:1]
    others = [b for b in args.batches if b not in batch1]
    stages = [("warps x stages", lambda best: warps_stages(grid)),
              ("block_n x cap", lambda best: tiles_caps(grid, best)),
              ("split options", lambda best: split_options(grid, best))]  # fmt: skip
    for number, (stage, candidates) in enumerate(stages):
        if number and sweep.over_budget():
            emit(dict(case="budget_spent", skipped=stage,
                      seconds=round(time.perf_counter() - sweep.started)))  # fmt: skip
            continue
        for name, context in cases:
            for batch in batch1:
                if number and sweep.over_budget():
                    break
                sweep.measure(name, batch, context, candidates(sweep.best(name, batch, context)))
        emit(dict(case="stage_done", stage=stage, seconds=round(time.perf_counter() - sweep.started)))  # fmt: skip
    for name, context in cases:  # the sanity check: the batch-1 winner at other batches
        for batch in others:
            sweep.measure(name, batch, context, [Config(), sweep.best(name, batch1[0], context)])
    summarize(sweep, args)
    return sweep


def summarize(sweep: Sweep, args) -> list[dict]:
    rows = []
    order = {name: i for i, name in enumerate(args.shapes_table)}
    keys = sorted(sweep.results, key=lambda key: (order[key[0]], key[2], key[1]))
    for name, batch, context in keys:
        record = sweep.results[(name, batch, context)]
        shape = args.shapes_table[name]
        kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim * 2  # bf16
        default_us = record.get(Config(), math.inf)
        best = sweep.best(name, batch, context)
        best_us = record.get(best, math.inf)
        ok = math.isfinite(default_us) and math.isfinite(best_us)
        row = dict(
            case="summary", shape=name, batch=batch, context=context,
            default_us=round(default_us, 3) if math.isfinite(default_us) else None,
            best_config=best.label, best=best.kwargs(),
            best_us=round(best_us, 3) if math.isfinite(best_us) else None,
            speedup=round(default_us / best_us, 3) if ok else None,
            default_tb_s=round(kv_bytes / default_us / 1e6, 3) if ok else None,
            best_tb_s=round(kv_bytes / best_us / 1e6, 3) if math.isfinite(best_us) else None,
            saved_us_per_step=round(shape.num_layers * (default_us - best_us), 1) if ok else None,
            configs_measured=len(record),
            failed=sum(1 for us in record.values() if not math.isfinite(us)),
        )  # fmt: skip
        emit(row)
        rows.append(row)
    print(table(rows), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    header = (f"{'shape':<14}{'batch':>6}{'context':>8}{'default us':>12}{'TB/s':>7}"
              f"{'best us':>10}{'TB/s':>7}{'x':>7}{'saved/step':>11}  best config")  # fmt: skip
    lines = [header]
    for row in rows:
        lines.append(
            f"{row['shape']:<14}{row['batch']:>6}{row['context']:>8}"
            f"{_num(row['default_us'], 12, 2)}{_num(row['default_tb_s'], 7, 2)}"
            f"{_num(row['best_us'], 10, 2)}{_num(row['best_tb_s'], 7, 2)}"
            f"{_num(row['speedup'], 7, 3)}{_num(row['saved_us_per_step'], 11, 1)}"
            f"  {row['best_config']}"
        )
    lines.append("(saved/step: us per decode step over the model's layers; failed configs "
                 "are in the JSON lines)")  # fmt: skip
    return "\n".join(lines)


def _num(value, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="*", default=None, help=" ".join(SHAPES))
    parser.add_argument("--contexts", nargs="*", type=int, default=list(CONTEXTS))
    parser.add_argument("--batches", nargs="*", type=int, default=list(BATCHES))
    parser.add_argument("--max-model-len", type=int, default=16384,
                        help="the block table's width in tokens (the engine's max_model_len)")  # fmt: skip
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a small grid")
    parser.add_argument("--calls", type=int, default=32, help="calls per CUDA graph (at least)")
    parser.add_argument("--replays", type=int, default=15)
    parser.add_argument("--rotation-bytes", type=int, default=3 * L2_BYTES,
                        help="KV the calls of one graph rotate over (0: one block table)")  # fmt: skip
    parser.add_argument("--max-rotations", type=int, default=1024)
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch without programmatic dependent launch (on by default)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="past this many seconds stages 2 and 3 are skipped")  # fmt: skip
    args = parser.parse_args(argv)
    names = args.shapes or list(SHAPES)
    args.shapes_table = {name: SHAPES[name] for name in names}
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_attention_sweep needs a CUDA GPU", file=sys.stderr)
        return 1
    from atom.forward_context import forward_context
    from atom.fusions import Fusions
    from atom.kernels.pdl import pdl_launch

    fusions = dataclasses.replace(Fusions(), pdl=not args.no_pdl)
    probe = torch.empty(1, device="cuda")
    start = time.perf_counter()
    # a forward context holds the fusions only: paged_decode_attention reads no metadata
    with torch.inference_mode(), forward_context(None, fusions):
        emit(dict(case="setup", gpu=torch.cuda.get_device_name(), pdl=pdl_launch(probe)[0],
                  multi_processors=decode_attention.multi_processors(probe.device),
                  quick=args.quick, max_model_len=args.max_model_len))  # fmt: skip
        run_sweep(args, "cuda")
    print(f"# decode_attention_sweep took {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the host time of an engine decode step goes, plain greedy vs sampling options.

    python -m benchmarks.engine_host_profile                 # CPU: tiny model
    python -m benchmarks.engine_host_profile --model llama-1b   # H200: 1B shape
    python -m benchmarks.engine_host_profile --cprofile 30   # and the top functions
    python -m benchmarks.engine_host_profile --model smollm2 --batch 1 --only plain

One engine (random weights, `load_format="dummy"`, no tokenizer) generates --batch
prompts of --prompt-len tokens, --decode-len tokens each, twice: plain greedy, then the
sampler benchmark's options (presence 0.5, frequency 0.3, repetition 1.1, 16 logit_bias
entries, 20 logprobs per row; benchmarks/sampler.py). The engine's step methods are
wrapped (no engine code changes) and each phase's *exclusive* wall time is summed over the
decode-only steps (steps that launched and completed decode batches only):

    schedule      Scheduler.schedule
    prepare       RunnerSlot.prepare (numpy staging, page table, SamplingPlan.stage)
    publish       SamplingPlan.publish + RunnerSlot.flush (H2D copies, page-table apply)
    forward       the model's forward and LM head (or the CUDA-graph replay)
    sample        SamplingPlan.sample / Sampler (kernels or their torch references)
    d2h           StepHandle.of: the non-blocking copies of tokens and logprobs
    wait          StepHandle.result: waiting for the device + tokens to a list
    logprobs      StepLogprobs.sampled / prompt_entries: tensors to Logprob objects
    on_complete   Scheduler.on_complete (placeholders, finish reasons, prefix hashes)
    output        the rest of LLMEngine._complete (StepOutputs, per-request logprobs)
    launch_other  the rest of ModelRunner.launch (publication calls, handle, slots)
    step_other    the rest of LLMEngine.step; `generate_other`: LLM.generate's loop

Each phase gets `ms` (mean per decode step: what throughput pays) and `median_ms` (robust
to pauses and to other processes on a shared machine). On CUDA the host phases are enqueue
time (the device runs asynchronously, CUDA graphs replay the forward) and `wait` is where
the device time shows: with asynchronous scheduling a step costs about
max(device time, host time), so `host_ms_outside_compute` + the `sample` enqueue must stay
below the device's step. On CPU `forward` and `sample` are model compute (irrelevant on a
GPU, where they are queued) and the other phases are host work.

The second pass (skip: --no-count-ops) runs under a TorchDispatchMode: per phase its torch
ops per step (`ops`: a launch each on a GPU; note the CPU `sample` runs the torch
references, not the CUDA path's kernels), their time inside the mode (`op_ms`) and
`sync_ops`: ops that would synchronize a CUDA device (`.item()`, nonzero, masked_select,
boolean-mask indexing, copies to pageable host memory). On CUDA the first pass also counts,
by phase, the syncs torch's sync debug mode reports (`cuda_syncs`; the event wait in
`wait` is not one of them). `gc_ms`: the garbage collector's pauses per decode step, inside
whichever phase they hit, and the collections of the whole run per generation.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import pstats
import shutil
import statistics
import tempfile
import time
import warnings
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.harness import emit
from benchmarks.sampler import options

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
PHASES = (
    "schedule",
    "prepare",
    "publish",
    "forward",
    "sample",
    "d2h",
    "wait",
    "logprobs",
    "on_complete",
    "output",
    "launch_other",
    "step_other",
    "generate_other",
)


class PhaseClock:
    """Exclusive wall time per phase: a wrapped call's time minus its wrapped callees'."""

    def __init__(self):
        self.stack: list[list] = []  # [phase, start, children seconds]
        self.step: dict[str, float] = defaultdict(float)
        self.decode_only = True
        self.records: list[dict[str, float]] = []  # per decode step: phase -> seconds
        self.gc_step = 0.0  # garbage-collector pauses of the step (inside its phases)
        self.gc_records: list[float] = []
        self.gc_by_generation = [0.0, 0.0, 0.0]  # the whole run, prefill steps too
        self.gc_counts = [0, 0, 0]
        self.totals: dict[str, float] = defaultdict(float)
        self.ops: dict[str, int] = defaultdict(int)
        self.op_seconds: dict[str, float] = defaultdict(float)
        self.sync_ops: dict[str, int] = defaultdict(int)
        self.cuda_syncs: dict[str, int] = defaultdict(int)
        self.steps = 0

    @property
    def phase(self) -> str:
        return self.stack[-1][0] if self.stack else "generate_other"

    def wrap(self, phase: str, fn):
        clock = self

        def wrapped(*args, **kwargs):
            stack = clock.stack
            stack.append([phase, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                name, start, children = stack.pop()
                elapsed = time.perf_counter() - start
                clock.step[name] += elapsed - children
                if stack:
                    stack[-1][2] += elapsed

        return wrapped

    def end_step(self) -> None:
        if self.decode_only:
            self.steps += 1
            self.records.append(self.step)
            self.gc_records.append(self.gc_step)
            for name, seconds in self.step.items():
                self.totals[name] += seconds
        self.step = defaultdict(float)
        self.gc_step = 0.0
        self.decode_only = True


@contextlib.contextmanager
def instrumented(clock: PhaseClock):
    """Wrap the engine's step methods (class attributes; restored on exit)."""
    from atom.model_engine import cuda_graphs, llm_engine, model_runner, runner_slot, scheduler
    from atom.model_engine.sampling import logprobs, plan, sampler

    originals = []

    def patch(owner, name: str, phase: str, wrapper=None):
        original = owner.__dict__[name]
        fn = original.__func__ if isinstance(original, classmethod) else original
        wrapped = clock.wrap(phase, wrapper(fn) if wrapper else fn)
        setattr(owner, name, classmethod(wrapped) if isinstance(original, classmethod) else wrapped)
        originals.append((owner, name, original))

    def note_batch(fn):  # a step counts when every batch it touched is decode-only
        def call(self, batch, *args):
            clock.decode_only &= batch.is_decode_only
            return fn(self, batch, *args)

        return call

    def note_scheduled(fn):
        def call(self, *args, **kwargs):
            batch = fn(self, *args, **kwargs)
            if batch is not None:
                clock.decode_only &= batch.is_decode_only
            return batch

        return call

    engine, runner = llm_engine.LLMEngine, model_runner.ModelRunner
    patch(engine, "step", "step_other")
    patch(engine, "_complete", "output", note_batch)
    patch(scheduler.Scheduler, "schedule", "schedule", note_scheduled)
    patch(scheduler.Scheduler, "on_complete", "on_complete")
    patch(runner, "launch", "launch_other")
    patch(runner, "_forward", "forward")
    patch(runner_slot.RunnerSlot, "prepare", "prepare")
    patch(runner_slot.RunnerSlot, "_flush", "publish")
    patch(plan.SamplingPlan, "publish", "publish")
    patch(plan.SamplingPlan, "sample", "sample")
    patch(sampler.Sampler, "__call__", "sample")
    patch(cuda_graphs.DecodeGraphs, "run", "forward")
    patch(model_runner.StepHandle, "of", "d2h")
    patch(model_runner.StepHandle, "result", "wait")
    patch(logprobs.StepLogprobs, "sampled", "logprobs")
    patch(logprobs.StepLogprobs, "prompt_entries", "logprobs")
    for name in ("compute_logits",):  # the LM head: the model class of the engine
        for cls in _model_classes():
            if name in cls.__dict__:
                patch(cls, name, "forward")
    try:
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def _model_classes():
    from atom.models.llama import LlamaForCausalLM

    return [LlamaForCausalLM]


_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "item"}


class OpCounter(TorchDispatchMode):
    """Torch ops by phase, their time, and those that would synchronize a CUDA device."""

    def __init__(self, clock: PhaseClock):
        super().__init__()
        self.clock = clock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        clock = self.clock
        phase = clock.phase
        name = func.__name__.split(".")[0]
        clock.ops[phase] += 1
        if name in _SYNC_OPS or _bool_index(name, args) or _to_pageable_host(name, args, kwargs):
            clock.sync_ops[phase] += 1
        start = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - start
        clock.op_seconds[phase] += seconds
        return out


def _bool_index(name: str, args) -> bool:
    if name not in ("index", "index_put", "index_put_"):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _to_pageable_host(name: str, args, kwargs) -> bool:
    if name not in ("_to_copy", "copy_"):
        return False
    if name == "copy_":
        dst, src = args[0], args[1]
        return src.is_cuda and not dst.is_cuda and not dst.is_pinned()
    src = args[0]
    device = kwargs.get("device")
    return src.is_cuda and device is not None and torch.device(device).type == "cpu" and not kwargs.get("pin_memory")  # fmt: skip


def build_llm(args):
    import transformers

    from atom.model_engine.llm import LLM
    from benchmarks.decode_profile import SMOLLM2_135M
    from benchmarks.offline_throughput import LLAMA_32_1B

    shapes = {"llama-1b": LLAMA_32_1B, "smollm2": SMOLLM2_135M, "tiny": TINY}
    shape = dict(shapes[args.model])
    if args.vocab:
        shape["vocab_size"] = args.vocab
    elif args.model == "tiny":
        shape["vocab_size"] = 32768
    directory = tempfile.mkdtemp(prefix="atom-host-profile-")
    transformers.LlamaConfig(**shape).save_pretrained(directory)
    kwargs = dict(
        load_format="dummy",
        skip_tokenizer_init=True,
        device=args.device,
        max_model_len=args.prompt_len + args.decode_len + 16,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(8192, args.batch),
        enable_prefix_caching=False,
        seed=0,
    )
    if args.device == "cuda":
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        kwargs.update(dtype="float32", kv_cache_memory_bytes=256 << 20)
    try:
        return LLM(directory, **kwargs), shape["vocab_size"]
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # read at start-up only


def measure(llm, prompts, params, args, count_ops: bool, profile: cProfile.Profile | None):
    from atom.model_engine import llm_engine

    clock = PhaseClock()

    last_end = [None]

    def step_and_count(self, step):
        if last_end[0] is not None:  # LLM.generate's own work since the last step
            clock.step["generate_other"] += time.perf_counter() - last_end[0]
        try:
            return step(self)
        finally:
            clock.end_step()
            last_end[0] = time.perf_counter()

    sync = torch.cuda.is_available() and args.device == "cuda"
    counter = OpCounter(clock) if count_ops else contextlib.nullcontext()
    with contextlib.ExitStack() as stack:
        stack.enter_context(instrumented(clock))
        step = llm_engine.LLMEngine.step  # wrapped by `instrumented`
        llm_engine.LLMEngine.step = lambda self: step_and_count(self, step)
        stack.callback(setattr, llm_engine.LLMEngine, "step", step)
        if sync:
            stack.enter_context(_cuda_sync_counter(clock))
        stack.enter_context(_gc_clock(clock))
        stack.enter_context(counter)
        if profile is not None:
            profile.enable()
        begin = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        if profile is not None:
            profile.disable()
    return clock, seconds


@contextlib.contextmanager
def _gc_clock(clock: PhaseClock):
    """The garbage collector's pauses, per step (inside whichever phase they hit)."""
    began = [0.0]

    def callback(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            seconds = time.perf_counter() - began[0]
            clock.gc_step += seconds
            clock.gc_by_generation[info["generation"]] += seconds
            clock.gc_counts[info["generation"]] += 1

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


@contextlib.contextmanager
def _cuda_sync_counter(clock: PhaseClock):
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    show = warnings.showwarning

    def count(message, category, *rest):
        if "synchronizing" in str(message).lower():
            clock.cuda_syncs[clock.phase] += 1
            return None
        return show(message, category, *rest)

    warnings.showwarning = count
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = count
            yield
    finally:
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode(previous)


def report(case: str, clock: PhaseClock, ops: PhaseClock | None, seconds: float) -> dict:
    """Per phase: mean and median ms per decode step; with the counted pass its ops, their
    time, the Python time around them and the ops that would synchronize a GPU."""
    steps = max(clock.steps, 1)
    phases = {}
    for name in PHASES:
        wall = clock.totals.get(name, 0.0) * 1e3 / steps
        median = (
            statistics.median(r.get(name, 0.0) for r in clock.records) if clock.records else 0.0
        )
        entry = {"ms": round(wall, 4), "median_ms": round(median * 1e3, 4)}
        if ops is not None and ops.steps:
            n = ops.steps
            entry.update(
                ops=round(ops.ops.get(name, 0) / n, 1),
                op_ms=round(ops.op_seconds.get(name, 0.0) * 1e3 / n, 4),
                sync_ops=round(ops.sync_ops.get(name, 0) / n, 2),
            )
        if clock.cuda_syncs:
            entry["cuda_syncs"] = round(clock.cuda_syncs.get(name, 0) / steps, 2)
        phases[name] = entry
    totals = [sum(r.values()) for r in clock.records] or [0.0]
    record = dict(
        case=case,
        decode_steps=clock.steps,
        step_ms=round(sum(p["ms"] for p in phases.values()), 4),
        step_median_ms=round(statistics.median(totals) * 1e3, 4),
        gc_ms=round(sum(clock.gc_records) * 1e3 / steps, 4),
        gc_collections=clock.gc_counts,  # the whole generate, per generation 0 / 1 / 2
        gc_ms_by_generation=[round(s * 1e3, 2) for s in clock.gc_by_generation],
        generate_s=round(seconds, 3),
        phases=phases,
    )
    compute = ("forward", "sample", "wait")  # model compute on CPU; enqueue + wait on CUDA
    record["host_ms_outside_compute"] = round(
        sum(p["ms"] for name, p in phases.items() if name not in compute), 4
    )
    if ops is not None and ops.steps:
        record["ops_per_step"] = round(sum(p.get("ops", 0) for p in phases.values()), 1)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=("tiny", "llama-1b", "smollm2"), default=None)
    parser.add_argument("--vocab", type=int, default=None, help="tiny default 32768")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=None, help="CPU 32, CUDA 512")
    parser.add_argument("--decode-len", type=int, default=None, help="CPU 16, CUDA 128")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--no-count-ops", action="store_true", help="skip the op-count pass")
    parser.add_argument("--only", choices=("plain", "with_options"), default=None)
    parser.add_argument("--cprofile", type=int, default=0, help="top N functions (options run)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.model = args.model or ("llama-1b" if cuda else "tiny")
    args.prompt_len = args.prompt_len or (512 if cuda else 32)
    args.decode_len = args.decode_len or (128 if cuda else 16)

    llm, vocab = build_llm(args)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, vocab - 10, (args.batch, args.prompt_len), generator=generator)
    prompts = prompts.tolist()
    bias = torch.randint(0, vocab, (16,), generator=generator).tolist()
    from atom.sampling_params import SamplingParams

    cases = {
        "plain": SamplingParams(temperature=0.0, max_tokens=args.decode_len, ignore_eos=True),
        "with_options": SamplingParams(**options(args.decode_len, bias)),
    }
    # warm-up: every path once (kernels compiled, graphs captured, state allocated)
    llm.generate(prompts[:8], SamplingParams(**options(3, bias)), use_tqdm=False)
    llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    emit(dict(case="config", device=args.device, model=args.model, vocab=vocab, batch=args.batch,
              prompt_len=args.prompt_len, decode_len=args.decode_len))  # fmt: skip
    records = {}
    for case, params in cases.items():
        if args.only and case != args.only:
            continue
        profile = (
            cProfile.Profile() if args.cprofile and case == (args.only or "with_options") else None
        )
        clock, seconds = measure(llm, prompts, params, args, False, profile)
        ops = None
        if not args.no_count_ops:
            ops, _ = measure(llm, prompts, params, args, True, None)
        records[case] = report(case, clock, ops, seconds)
        emit(records[case])
        if profile is not None:
            stats = pstats.Stats(profile)
            stats.sort_stats("tottime").print_stats(args.cprofile)
            stats.sort_stats("cumulative").print_stats("atom/", args.cprofile)
    if len(records) == 2:
        plain, with_options = records["plain"], records["with_options"]
        extra = {
            name: round(with_options["phases"][name]["ms"] - plain["phases"][name]["ms"], 4)
            for name in PHASES
        }
        emit(dict(case="summary", plain_step_ms=plain["step_ms"],
                  with_options_step_ms=with_options["step_ms"],
                  extra_ms=round(with_options["step_ms"] - plain["step_ms"], 4),
                  extra_ms_by_phase=extra))  # fmt: skip
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

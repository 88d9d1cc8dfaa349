"""Batch-1 decode, kernel by kernel, and the fused-kernel ablation (issue 17).

    python -m benchmarks.offline_throughput --profile-kernels   # the engine's defaults
    python -m benchmarks.offline_throughput --ablate            # every fusion on/off

For each shape (Llama-3.2-1B, SmolLM2-135M; random bf16 weights, CUDA graphs on, batch 1)
and each configuration of atom/fusions.py, one engine is built and measured:

- `decode_ms_per_step` / `decode_tok_s`: wall time of steady decode steps (the median of
  three windows of --window-steps), and `output_tok_s`: a whole --batch1-output-len-token
  generate from a --batch1-input-len-token prompt (prefill included, as the
  throughput benchmark's `batch1_decode`);
- from torch.profiler over --profile-steps decode steps: `kernels_per_step` (device
  kernels, the graph's included), `copies_per_step` (memcpy / memset), `gpu_us_per_step`
  (the device's busy time: the union of their [start, end], so kernels that overlap under
  programmatic dependent launch count once), `kernel_sum_us_per_step` (their durations
  summed: a kernel waiting under PDL counts while it waits) and the top kernels by time;
- `fraction_of_weight_read_limit`: (weight bytes / streaming-read bandwidth) / step time,
  the bandwidth measured in the same process (`stream_read`: a sum over a 4 GiB buffer;
  `stream_copy` reads and writes). `..._gpu` uses the GPU time instead of the wall time.

`--ablate` measures the baseline (every fusion off), each fusion alone, all of them, the
engine's defaults and the baseline again (`baseline_end`: the drift of the machine during
the run), then prints per shape each configuration's speed-up over the baseline in this
run (ratios within one process: the machines are noisy), and the defaults it suggests
(fusions alone faster than the baseline by > 1%). One engine per shape serves every
configuration: `ModelRunner.set_fusions` captures its decode graph again.
`--ablate-throughput` runs the 256-prompt throughput workload with every fusion off, with
the defaults, with the defaults but PDL off, and with the defaults again (after the batch-1
part when given with `--ablate`).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import tempfile
import time

import torch

from atom.fusions import Fusions, names
from benchmarks.harness import emit, streaming_bandwidth
from benchmarks.model_shapes import SMOLLM2_135M  # noqa: F401 (other benchmarks')

# the shapes --profile-kernels and --ablate measure unless --shapes names others
KERNEL_SHAPES = ("llama-3.2-1b", "smollm2-135m")


def shapes() -> dict[str, dict]:
    """'<name>-shape' -> config fields, every shape of model_shapes.MATRIX."""
    from benchmarks.model_shapes import MATRIX

    return {f"{name}-shape": fields for name, (_, fields) in MATRIX.items()}


def selected_shapes(names: list[str] | None, default=KERNEL_SHAPES) -> list[str]:
    """The shape names to run: `names` (all of the matrix when empty), else `default`."""
    from benchmarks.model_shapes import MATRIX

    if names is None:
        return list(default)
    unknown = [name for name in names if name not in MATRIX]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {list(MATRIX)}")
    return list(names) or list(MATRIX)


def _device_time_us(event) -> float:
    return event.time_range.elapsed_us()


def gpu_gaps(ranges, steps: int, idle_us: float = 20.0) -> dict:
    """The device timeline per step, from the profiler's [start, end] of each device
    event: its busy time (the union of the spans: kernels overlapping under PDL count once)
    and its idle time, gaps shorter than `idle_us` between kernels (inside a graph: launch
    latency) and longer ones (the device waiting for the host)."""
    spans = sorted((r.start, r.end) for r in ranges)
    if not spans:
        return {}
    short = long = 0.0
    busy_start, busy_end = spans[0]
    busy = 0.0  # the union of the spans
    for start, end in spans[1:]:
        gap = start - busy_end
        if gap > 0:
            if gap < idle_us:
                short += gap
            else:
                long += gap
            busy += busy_end - busy_start
            busy_start = start
        busy_end = max(busy_end, end)
    busy += busy_end - busy_start
    return dict(
        gpu_us_per_step=round(busy / steps, 1),
        launch_gaps_us_per_step=round(short / steps, 1),
        host_wait_us_per_step=round(long / steps, 1),
    )


def kernel_profile(engine, steps: int, top: int) -> dict:
    """Kernels, copies and device time per decode step over `steps` engine steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    # the device's own activity (not the ATOM:: ranges a profiler may mirror on it)
    events = [
        event
        for event in prof.events()
        if event.device_type == DeviceType.CUDA and not event.name.startswith("ATOM::")
    ]
    timeline = gpu_gaps([event.time_range for event in events], steps)
    kernels = copies = 0
    total_us = 0.0
    by_name: dict[str, list[float]] = {}
    device_events = [(event.name, 1, _device_time_us(event)) for event in events]
    if not device_events:  # a profiler that lists device activity only in its averages
        device_events = [
            (entry.key, entry.count, entry.self_device_time_total)
            for entry in prof.key_averages()
            if entry.device_type == DeviceType.CUDA or entry.self_device_time_total > 0
        ]
    for name, count, us in device_events:
        total_us += us
        if name.lower().startswith(("memcpy", "memset")):
            copies += count
        else:
            kernels += count
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += count
        entry[1] += us
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    record = dict(
        kernels_per_step=round(kernels / steps, 1),
        copies_per_step=round(copies / steps, 1),
        gpu_us_per_step=round(total_us / steps, 1),  # the sum, where there is no timeline
        kernel_sum_us_per_step=round(total_us / steps, 1),
    )
    record.update(timeline)  # gpu_us_per_step: the busy time
    record["top_kernels"] = [
        [name[:90], round(count / steps, 1), round(us / steps, 1)] for name, (count, us) in ranked
    ]
    # the first step's kernels in launch order (each step replays the same ones)
    ordered = sorted((_start_us(event), name, us) for event, (name, _, us) in
                     zip(events, device_events, strict=False))  # fmt: skip
    per_step = len(ordered) // steps if steps else 0
    record["first_step"] = [[name[:60], round(us, 1)] for _, name, us in ordered[:per_step]]
    return record


def _start_us(event) -> float:
    time_range = getattr(event, "time_range", None)
    return float(getattr(time_range, "start", 0.0)) if time_range is not None else 0.0


def build_engine(model_dir: str, args, fusions: Fusions):
    from atom.model_engine.llm import LLM

    max_model_len = args.input_len + args.output_len + 16
    return LLM(
        model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=max_model_len,  # as the throughput run
        max_num_seqs=1,
        max_num_batched_tokens=1024,
        num_kvcache_blocks=max(512, -(-max_model_len // 16) + 8),  # 16-token blocks
        cuda_graph_batch_sizes=[1],
        fusions=fusions,
    )


def measure(llm, shape: str, fusions: Fusions, args, bandwidth: dict) -> dict:
    """One configuration on an idle engine: its decode graphs are captured again with
    `fusions` (ModelRunner.set_fusions), the weights and the KV cache stay."""
    from atom.sampling_params import SamplingParams
    from benchmarks.offline_throughput import random_prompts

    engine = llm.engine
    engine.model_runner.set_fusions(fusions)
    vocab = engine.hf_config.vocab_size
    prompt = random_prompts(1, args.batch1_input_len, vocab, seed=7)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([prompt], greedy, use_tqdm=False)  # compile and warm up

    generate = SamplingParams(temperature=0.0, max_tokens=args.batch1_output_len, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = llm.generate([prompt], generate, use_tqdm=False)[0]
    output_tok_s = len(out.token_ids) / (time.perf_counter() - start)

    windows, window = 3, args.window_steps
    total = 8 + windows * window + args.profile_steps + 4
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True))
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(8):
        engine.step()
    step_seconds = []
    for _ in range(windows):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(window):
            engine.step()
        torch.cuda.synchronize()
        step_seconds.append((time.perf_counter() - start) / window)
    profile = kernel_profile(engine, args.profile_steps, args.top_kernels)
    while engine.has_unfinished():
        engine.step()

    model = engine.model_runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    step_s = statistics.median(step_seconds)
    limit_s = weight_bytes / bandwidth["stream_read"]
    gpu_us = profile["gpu_us_per_step"]
    return dict(
        case="batch1_kernels",
        model=shape,
        fusions=fusions.enabled() or ["none"],
        decode_ms_per_step=round(step_s * 1e3, 4),
        decode_tok_s=round(1 / step_s, 1),
        output_tok_s=round(output_tok_s, 1),
        weight_bytes=weight_bytes,
        weight_read_limit_ms=round(limit_s * 1e3, 4),
        fraction_of_weight_read_limit=round(limit_s / step_s, 3),
        fraction_of_weight_read_limit_gpu=round(limit_s * 1e6 / gpu_us, 3) if gpu_us else None,
        **profile,
    )


# Candidate default sets beside `all`: the kernel fusions without the attention variants,
# then with each of them (the attention kernels won or lost on their own in the sweeps).
KERNEL_SET = ("rope_kv_write", "greedy_argmax", "gemv_silu", "gemv_linear", "norm_gemv")
CANDIDATE_SETS = {
    "gemv_set": KERNEL_SET,
    "gemv_set+rope_kv": (*KERNEL_SET, "gemv_rope_kv"),
    "gemv_set+rope_kv+pdl": (*KERNEL_SET, "gemv_rope_kv", "pdl"),
}


def configurations(ablate: bool) -> list[tuple[str, Fusions]]:
    default = Fusions.from_env()
    if not ablate:
        return [("default", default)]
    configs = [("baseline", Fusions.none())]
    configs += [(name, Fusions.only(name)) for name in names()]
    configs.append(("all", Fusions.only(*names())))
    configs += [(label, Fusions.only(*members)) for label, members in CANDIDATE_SETS.items()]
    if default not in {fusions for _, fusions in configs}:
        configs.append(("default", default))
    # the baseline once more at the end: how much the machine drifted during the run
    configs.append(("baseline_end", Fusions.none()))
    return configs


def baseline_ms(records: list[tuple[str, dict]]) -> float | None:
    """The baseline's step time: the mean of its first and last measurement (drift); None
    when the run measured no baseline (--profile-kernels: the defaults alone)."""
    times = [r["decode_ms_per_step"] for label, r in records if label.startswith("baseline")]
    return sum(times) / len(times) if times else None


def print_table(shape: str, records: list[tuple[str, dict]]) -> None:
    base_ms = baseline_ms(records)
    print(f"\n{shape}, batch 1 (speed-up = mean baseline step time / this one)", file=sys.stderr)
    print(
        f"{'config':<14}{'tok/s':>9}{'ms/step':>9}{'speed-up':>9}{'kernels':>9}"
        f"{'GPU us':>9}{'of limit':>9}",
        file=sys.stderr,
    )
    for label, r in records:
        speedup = f"{base_ms / r['decode_ms_per_step']:>9.3f}" if base_ms else f"{'-':>9}"
        print(
            f"{label:<14}{r['decode_tok_s']:>9.0f}{r['decode_ms_per_step']:>9.3f}"
            f"{speedup}{r['kernels_per_step']:>9.1f}{r['gpu_us_per_step']:>9.1f}"
            f"{r['fraction_of_weight_read_limit']:>9.2f}",
            file=sys.stderr,
        )


def print_top_kernels(label: str, record: dict) -> None:
    print(f"\n{record['model']} [{label}]: top kernels per decode step", file=sys.stderr)
    for name, count, us in record["top_kernels"]:
        print(f"  {us:>8.1f} us {count:>6.1f}x  {name}", file=sys.stderr)


def print_policy(shape: str, report: list[dict]) -> None:
    """The GEMV policy's choice per batch-1 linear layer shape, and why."""
    print(f"\n{shape}: GEMV policy (atom/kernels/gemv_policy.py)", file=sys.stderr)
    for row in report:
        choice = "unfused" if row["choice"] == "unfused" else f"Triton {tuple(row['choice'])}"
        print(f"  {row['site']:<28}{choice:<26}{row['source']:<9}{row['reason']}",
              file=sys.stderr)  # fmt: skip


def policy_record() -> dict:
    """What the process's GEMV policy decided since it was (re)built: per site, and the
    time its trials took."""
    from atom.kernels import gemv_policy

    policy = gemv_policy.current_policy()
    report = policy.report()
    return dict(
        gemv_policy=report,
        gemv_sites_fused=sum(row["choice"] != "unfused" for row in report),
        gemv_sites=len(report),
        gemv_trial_s=round(policy.spent_s, 3),
        gemv_compile_s=round(policy.compile_s, 2),
    )


def run(args) -> int:
    from atom.kernels import gemv_policy
    from benchmarks.model_shapes import hf_config

    if args.ablate_throughput and not (args.ablate or args.profile_kernels):
        throughput_ablation(args)
        return 0
    bandwidth = streaming_bandwidth()
    torch.cuda.empty_cache()
    emit(
        dict(
            case="stream_bandwidth",
            read_tb_s=round(bandwidth["stream_read"] / 1e12, 3),
            copy_tb_s=round(bandwidth["stream_copy"] / 1e12, 3),
            gpu=torch.cuda.get_device_name(),
        )
    )
    if getattr(args, "matrix", False):
        from benchmarks.shape_matrix import run_matrix

        run_matrix(args, bandwidth)
        return 0
    configs = configurations(args.ablate)
    if args.ablate and args.configs:  # a subset of the ablation, in its order
        configs = [(label, fusions) for label, fusions in configs if label in args.configs]
    suggested = {}
    for name in selected_shapes(args.shapes):
        shape, config = f"{name}-shape", hf_config(name)
        gemv_policy.set_policy(None)  # a fresh policy (the disk cache stays): its report
        records = []
        with tempfile.TemporaryDirectory() as model_dir:
            config.save_pretrained(model_dir)
            llm = build_engine(model_dir, args, configs[0][1])
            for label, fusions in configs:
                record = measure(llm, shape, fusions, args, bandwidth)
                record["config"] = label
                if label == "default":
                    record.update(policy_record())
                emit(record)
                records.append((label, record))
            llm.engine.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        print_table(shape, records)
        for label, record in records:
            if label in ("baseline", "all", "default"):
                print_top_kernels(label, record)
            if "gemv_policy" in record:
                print_policy(shape, record["gemv_policy"])
        if args.ablate:
            base = baseline_ms(records)
            suggested[shape] = [
                label
                for label, r in records
                if label in names() and base / r["decode_ms_per_step"] > 1.01
            ]
    if args.ablate:
        emit(dict(case="suggested_defaults", faster_alone_by_1_percent=suggested))
    if args.ablate_throughput:
        throughput_ablation(args)
    return 0


def throughput_ablation(args) -> None:
    """The 256-prompt throughput workload with every fusion off, with the defaults, the
    defaults without PDL, and the defaults again (the drift of the machine)."""
    import transformers

    from benchmarks.offline_throughput import LLAMA_32_1B, atom_runs, random_prompts

    config = transformers.LlamaConfig(**LLAMA_32_1B, architectures=["LlamaForCausalLM"])
    prompts = random_prompts(args.num_prompts, args.input_len, config.vocab_size, seed=0)
    single = random_prompts(1, args.batch1_input_len, config.vocab_size, seed=1)[0]
    results = {}
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        default = Fusions.from_env()
        for label, fusions in (
            ("baseline", Fusions.none()),
            ("default", default),
            ("default_no_pdl", dataclasses.replace(default, pdl=False)),
            ("default_end", default),
        ):
            throughput, _, batch1 = atom_runs(model_dir, args, prompts, single, fusions=fusions)
            results.setdefault(label.removesuffix("_end"), []).append(throughput)
            emit(
                dict(
                    case="throughput_ablation",
                    config=label,
                    fusions=fusions.enabled() or ["none"],
                    output_tok_s=round(throughput, 1),
                    batch1_output_tok_s=round(batch1, 1),
                    num_prompts=args.num_prompts,
                    input_len=args.input_len,
                    output_len=args.output_len,
                )
            )
    emit(
        dict(
            case="throughput_ablation_summary",
            default_over_baseline=round(
                statistics.mean(results["default"]) / results["baseline"][0], 3
            ),
            default_over_no_pdl=round(
                statistics.mean(results["default"]) / results["default_no_pdl"][0], 3
            ),
        )
    )

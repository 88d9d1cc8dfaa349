"""What penalties, logit_bias and top-20 logprobs cost beside a plain decode step.

    python -m benchmarks.sampler            # H200: batch 256, Llama-3.2-1B shape
    python -m benchmarks.sampler --device cpu --vocab 4096 --skip-engine   # smoke run
    python -m benchmarks.sampler --skip-engine --breakdown   # where the time goes

1. `sampler` (device time, CUDA events; wall time on CPU): the step's sampling on random
   bf16 logits [batch, vocab], plain greedy argmax vs the SamplingPlan with presence,
   frequency and repetition penalties, 16 logit_bias entries and 20 logprobs per row over
   prompts of --prompt-len and outputs of --output-len tokens (the SamplingState rows
   already built); plus the host time of the plan staged in a RunnerSlot and published:
   `host_plan_ms` for an unchanged decode batch (the steady state), and for the first
   step (every state row built from its tokens) and a step that replaces one request.
2. `engine` (CUDA): the same workload end to end, random Llama-3.2-1B-shape weights,
   --batch prompts decoding --decode-len tokens, plain greedy vs the options; decode
   milliseconds per step of each (a prefill-only run subtracted).

3. `--breakdown`: each piece of `plan.sample` alone and the logprob top-k alternatives
   (select, rounds, torch.topk) checked against a stable sort: see sampler_breakdown.py.

The figure the issue asks for: `extra_ms / decode_ms_per_step` < 10% (`extra_ms`: events
around back-to-back calls, so a host slower than the device shows; `extra_graph_ms`: the
same calls replayed from a CUDA graph, the device time alone).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch

from atom.model_engine.runner_slot import RunnerSlot
from atom.model_engine.sampling.sampler import Sampler, SamplingTensors
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.sequence import Sequence
from atom.sampling_params import SamplingParams
from benchmarks.harness import emit
from benchmarks.offline_throughput import LLAMA_32_1B


def options(max_tokens: int, bias_tokens: list[int]) -> dict:
    return dict(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        logit_bias={t: 1.5 for t in bias_tokens},
        logprobs=20,
    )


def timed(fn, device: torch.device, iters: int) -> float:
    """Milliseconds per call (CUDA events on a GPU, wall time on CPU)."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) * 1e3 / iters


def _decode_batch(seqs: list, layout: int, step: int) -> ScheduledBatch:
    return ScheduledBatch(seqs, [1] * len(seqs), len(seqs), layout=layout, grown=[], step=step)


def _stage_plan(slot: RunnerSlot, batch: ScheduledBatch):
    """Host side of one step's SamplingPlan (what RunnerSlot.prepare runs), published."""
    with slot.publisher.producer_guard(slot._staged):
        n = len(batch.seqs)
        cu = np.arange(n + 1, dtype=np.int64)
        ends = np.fromiter((len(s) for s in batch.seqs), np.int64, n)
        plan = slot._stage_sampling_plan(batch, batch.seqs, cu, ends)
        plan.publish(slot.buffers.sampling)
    slot.publisher.flush()
    return plan


def sampler_cost(args, device: torch.device) -> dict:
    generator = torch.Generator().manual_seed(0)
    vocab, batch = args.vocab, args.batch
    bias = torch.randint(0, vocab, (16,), generator=generator).tolist()
    params = SamplingParams(**options(args.output_len + 8, bias))
    seqs = []
    for _ in range(batch + 1):  # one spare: the "one request replaced" step
        ids = torch.randint(0, vocab, (args.prompt_len + args.output_len,), generator=generator)
        seq = Sequence(ids[: args.prompt_len].tolist(), params)
        seq.token_ids += ids[args.prompt_len :].tolist()
        seq.num_computed_tokens = len(seq) - 1  # a decode step
        seqs.append(seq)
    spare, seqs = seqs[-1], seqs[:-1]
    max_len = args.prompt_len + args.output_len + 16
    slot = RunnerSlot(0, batch, max(batch, 2048), -(-max_len // 16), 16, vocab, device)
    logits = torch.randn(batch, vocab, generator=generator).to(device, torch.bfloat16)
    sampler, greedy = Sampler(), SamplingTensors(all_greedy=True)

    def host_ms(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - begin) * 1e3

    # Host: the first step builds every state row (prompt + output tokens of each request);
    # the next steps of the same batch reuse the plan; replacing one request re-maps the
    # rows and builds one.
    step = iter(range(1, 1 << 30))
    plans = []
    first_ms = host_ms(lambda: plans.append(_stage_plan(slot, _decode_batch(seqs, 1, next(step)))))  # fmt: skip
    plans[-1].sample(sampler, logits, greedy)  # apply the builds
    steady = [host_ms(lambda: plans.append(_stage_plan(slot, _decode_batch(seqs, 1, next(step))))) for _ in range(args.iters)]  # fmt: skip
    replaced = [spare, *seqs[1:]]
    one_row_ms = host_ms(lambda: plans.append(_stage_plan(slot, _decode_batch(replaced, 2, next(step)))))  # fmt: skip
    plans[-1].sample(sampler, logits, greedy)
    plan = _stage_plan(slot, _decode_batch(replaced, 2, next(step)))  # reused: no builds

    plain_ms = timed(lambda: sampler(logits, greedy), device, args.iters)
    with_ms = timed(lambda: plan.sample(sampler, logits, greedy), device, args.iters)
    record = dict(
        case="sampler",
        device=str(device),
        batch=batch,
        vocab=vocab,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        plain_ms=round(plain_ms, 4),
        with_options_ms=round(with_ms, 4),
        extra_ms=round(with_ms - plain_ms, 4),
        host_plan_ms=round(sorted(steady)[len(steady) // 2], 4),  # unchanged batch, median
        host_plan_first_step_ms=round(first_ms, 3),  # every row built
        host_plan_one_row_changed_ms=round(one_row_ms, 3),
    )
    if device.type == "cuda":  # device time alone: replayed from a CUDA graph, no launches
        from benchmarks.sampler_breakdown import graph_ms

        plain_graph = graph_ms(lambda: sampler(logits, greedy), timed, device, args.iters)
        with_graph = graph_ms(lambda: plan.sample(sampler, logits, greedy), timed, device, args.iters)  # fmt: skip
        record.update(plain_graph_ms=plain_graph, with_options_graph_ms=with_graph)
        if isinstance(plain_graph, float) and isinstance(with_graph, float):
            record["extra_graph_ms"] = round(with_graph - plain_graph, 4)
    emit(record)
    if args.breakdown:
        from benchmarks.sampler_breakdown import run_breakdown

        run_breakdown(plan, sampler, logits, greedy, timed, emit, device, args.iters)
    return record


def engine_cost(args) -> dict:
    import transformers

    from atom.model_engine.llm import LLM

    directory = tempfile.mkdtemp(prefix="atom-sampler-bench-")
    transformers.LlamaConfig(**LLAMA_32_1B).save_pretrained(directory)
    llm = LLM(
        directory,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=args.prompt_len + args.decode_len + 16,
        max_num_seqs=args.batch,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
    )
    vocab = LLAMA_32_1B["vocab_size"]
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(1000, vocab - 1000, (args.batch, args.prompt_len), generator=generator)
    prompts = prompts.tolist()
    bias = torch.randint(0, vocab, (16,), generator=generator).tolist()

    def run(params: SamplingParams) -> tuple[float, int]:
        torch.cuda.synchronize()
        steps = llm.engine.stats.steps
        begin = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - begin, llm.engine.stats.steps - steps

    plain = SamplingParams(temperature=0.0, max_tokens=args.decode_len, ignore_eos=True)
    run(SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    run(SamplingParams(**options(4, bias)))
    prefill_s, prefill_steps = run(SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    record = dict(case="engine", batch=args.batch, prompt_len=args.prompt_len)
    for name, params in (("plain", plain), ("with_options", SamplingParams(**options(args.decode_len, bias)))):  # fmt: skip
        seconds, steps = run(params)
        decode_steps = max(1, steps - prefill_steps)
        record[f"{name}_decode_ms_per_step"] = round((seconds - prefill_s) / decode_steps * 1e3, 3)
    record["extra_fraction"] = round(
        record["with_options_decode_ms_per_step"] / record["plain_decode_ms_per_step"] - 1, 4
    )
    emit(record)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=LLAMA_32_1B["vocab_size"])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--decode-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="each piece of plan.sample and the top-k alternatives (benchmarks/sampler_breakdown.py)",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    micro = sampler_cost(args, device)
    if device.type == "cuda" and not args.skip_engine:
        macro = engine_cost(args)
        step_ms = macro["plain_decode_ms_per_step"]
        emit(
            dict(
                case="summary",
                plain_decode_ms_per_step=step_ms,
                sampler_extra_ms=micro["extra_ms"],
                sampler_extra_fraction_of_step=round(micro["extra_ms"] / step_ms, 4),
                sampler_device_extra_ms=micro.get("extra_graph_ms"),
                sampler_device_extra_fraction_of_step=(
                    round(micro["extra_graph_ms"] / step_ms, 4)
                    if "extra_graph_ms" in micro
                    else None
                ),
                engine_extra_fraction=macro["extra_fraction"],
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

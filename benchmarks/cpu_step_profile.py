"""One CPU decode step of the embedded SmolLM2, measured: ms per step, torch ops, top ops.

    python -m benchmarks.cpu_step_profile                       # this tree, batches 1 16 64
    python -m benchmarks.cpu_step_profile --trees /work/wt/before .  --rounds 2
    python -m benchmarks.cpu_step_profile --top 15 --batches 16

For each source tree (`--trees`, default this one) a worker process runs with that tree's
`atom` first on its path, so the same measurement runs on two versions of the engine; with
several trees and `--rounds` the workers alternate (tree A, tree B, tree A, ...), and the
table gives each tree's figures per round and the ratio of its median step CPU time to the
first tree's, from one run (the shared machine's load moves between processes more than a
change does).

A worker builds one engine (SmolLM2-135M-Instruct fp32 from the embedded GGUF, prefix
caching off), and for each batch size starts that many random --input-len-token prompts
(greedy, ignore_eos), steps through their prefill, then measures decode-only steps:

- `step_ms`: median wall time of `LLMEngine.step()` over --steps decode steps (scheduler,
  staging, forward, LM head, sampling, outputs); `step_cpu_ms`: the process's CPU time
  in it (with one thread, what the step costs whatever the other processes do: on a
  loaded machine compare this one);
- `forward_ms`: median of the model's forward + LM head inside those steps;
- `ops`: torch ops dispatched by one decode forward + LM head (a TorchDispatchMode);
- with --top N: torch.profiler over one more step, the N ops of largest self CPU time
  (ms per step, calls).

Thread count: ATOM_CPU_THREADS / OMP_NUM_THREADS as set by the caller (the engine's guess
otherwise); the worker prints the count it ran with and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def worker(batches: list[int], input_len: int, steps: int, top: int) -> None:
    """Measure in this process (the `atom` on sys.path); print one JSON line per batch."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from atom import LLM, SamplingParams
    from atom.forward_context import get_forward_context

    llm = LLM(device="cpu", max_num_seqs=max(batches), max_model_len=1024,
              enable_prefix_caching=False)  # fmt: skip
    engine = llm.engine
    runner = engine.model_runner
    model = runner.model
    vocab = model.lm_head.vocab_size
    generator = torch.Generator().manual_seed(0)

    class Clock:
        decode = False  # the last forward was a decode-only one
        forward = 0.0  # seconds of forward + LM head in the current step
        ops = 0
        counting = False

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Clock.ops += 1
            return func(*args, **(kwargs or {}))

    forward, logits = model.forward, model.compute_logits

    def timed_forward(*args, **kwargs):
        Clock.decode = get_forward_context().attention.is_decode
        start = time.perf_counter()
        if Clock.counting:
            with CountOps():
                out = forward(*args, **kwargs)
        else:
            out = forward(*args, **kwargs)
        Clock.forward += time.perf_counter() - start
        return out

    def timed_logits(hidden):
        start = time.perf_counter()
        if Clock.counting:
            with CountOps():
                out = logits(hidden)
        else:
            out = logits(hidden)
        Clock.forward += time.perf_counter() - start
        return out

    model.forward, model.compute_logits = timed_forward, timed_logits

    def start(batch: int, decode_steps: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=decode_steps, ignore_eos=True)
        for _ in range(batch):
            prompt = torch.randint(0, vocab, (input_len,), generator=generator).tolist()
            engine.add_request(prompt, params)

    def decode_step() -> tuple[float, float, float, bool]:
        Clock.forward, Clock.decode = 0.0, False
        begin, cpu = time.perf_counter(), time.process_time()
        engine.step()
        wall, cpu = time.perf_counter() - begin, time.process_time() - cpu
        return wall, cpu, Clock.forward, Clock.decode

    start(2, 8)  # warm-up
    while engine.has_unfinished():
        engine.step()
    for batch in batches:
        start(batch, steps + 16)
        for _ in range(4):  # prefill (in as many steps as the token budget needs)
            decode_step()
        wall, cpu, fwd = [], [], []
        while len(wall) < steps:
            seconds, cpu_seconds, forward_seconds, decode = decode_step()
            if decode:
                wall.append(seconds)
                cpu.append(cpu_seconds)
                fwd.append(forward_seconds)
        Clock.ops, Clock.counting = 0, True
        decode_step()
        Clock.counting = False
        record = dict(
            batch=batch,
            step_ms=round(1e3 * statistics.median(wall), 3),
            step_cpu_ms=round(1e3 * statistics.median(cpu), 3),
            forward_ms=round(1e3 * statistics.median(fwd), 3),
            ops=Clock.ops,
            threads=torch.get_num_threads(),
            load=round(os.getloadavg()[0], 2),
        )
        if top:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                decode_step()
            events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            record["top"] = [
                [e.key, round(e.self_cpu_time_total / 1e3, 3), e.count] for e in events[:top]
            ]
        print(json.dumps(record), flush=True)
        while engine.has_unfinished():
            engine.step()
    llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", default=[str(HERE.parents[1])],
                        help="source trees whose atom to measure, alternated")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per batch")
    parser.add_argument("--top", type=int, default=0, help="profile: the N ops of most time")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.batches, args.input_len, args.steps, args.top)
        return 0
    trees = [str(Path(t).resolve()) for t in args.trees]
    results: dict[tuple[str, int], list[dict]] = {}
    for round_ in range(args.rounds):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=tree)
            command = [sys.executable, str(HERE), "--worker", "--batches",
                       *map(str, args.batches), "--input-len", str(args.input_len),
                       "--steps", str(args.steps), "--top", str(args.top)]  # fmt: skip
            out = subprocess.run(command, env=env, cwd=tree, check=True, capture_output=True,
                                 text=True).stdout  # fmt: skip
            for line in out.splitlines():
                if line.startswith("{"):
                    record = dict(json.loads(line), tree=tree, round=round_)
                    print(json.dumps(record), flush=True)
                    results.setdefault((tree, record["batch"]), []).append(record)
    print("| batch | tree | step ms (per round) | step CPU ms | forward ms | ops "
          "| step CPU vs first tree |", file=sys.stderr)  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |", file=sys.stderr)
    for batch in args.batches:
        first = None
        for tree in trees:
            rows = results[(tree, batch)]
            median = statistics.median(r["step_cpu_ms"] for r in rows)
            first = first or median
            step_ms = " / ".join(f"{r['step_ms']:.1f}" for r in rows)
            cpu_ms = " / ".join(f"{r['step_cpu_ms']:.1f}" for r in rows)
            forward_ms = " / ".join(f"{r['forward_ms']:.1f}" for r in rows)
            print(f"| {batch} | {Path(tree).name} | {step_ms} | {cpu_ms} | {forward_ms} | "
                  f"{rows[0]['ops']} | {median / first:.2f} |", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

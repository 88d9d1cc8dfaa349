"""Offline throughput and batch-1 decode speed, atom beside HF transformers in one run.

    python -m benchmarks.offline_throughput --num-prompts 256 --input-len 512 --output-len 256
    python -m benchmarks.offline_throughput --profile-kernels   # batch-1 kernels per step
    python -m benchmarks.offline_throughput --ablate            # each fusion on / off
    python -m benchmarks.offline_throughput --shapes            # the batch-1 shape matrix

Random weights in the Llama-3.2-1B shape (bf16, CUDA), random prompt token ids,
ignore_eos. Prints one JSON line per measurement and a summary with the ratios.
`--profile-kernels` and `--ablate` measure batch-1 decode of the Llama-3.2-1B and
SmolLM2-135M shapes kernel by kernel instead (benchmarks/decode_profile.py), or of
the shapes `--shapes` names. `--shapes` alone (names or none: every shape of
benchmarks/model_shapes.py) runs the shape matrix instead: batch-1 decode with the
defaults and with every fusion off per shape, side by side, with each one's fraction of
the weight-read limit (benchmarks/shape_matrix.py).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time

import torch

from benchmarks.harness import emit
from benchmarks.model_shapes import LLAMA_32_1B  # noqa: F401 (other benchmarks')


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1000, vocab - 1000, (n, length), generator=generator).tolist()


def hf_generate_tok_s(config, prompts, output_len: int, batch_size: int) -> float:
    import transformers

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    generated, start = 0, None
    for i in range(0, len(prompts) + 1, batch_size):  # batch 0 is a warm-up
        chunk = prompts[max(0, i - batch_size) : i] if i else prompts[:1]
        ids = torch.tensor(chunk, device="cuda")
        limit = output_len if i else 4
        torch.cuda.synchronize()
        if i and start is None:
            start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=limit,
                min_new_tokens=limit,
                do_sample=False,
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        if i:
            generated += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    seconds = time.perf_counter() - start
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return generated / seconds


def atom_runs(model_dir: str, args, prompts, single, fusions=None) -> tuple[float, float, float]:
    from atom.model_engine.llm import LLM
    from atom.sampling_params import SamplingParams

    llm = LLM(
        model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        fusions=fusions,
    )
    vocab = llm.engine.hf_config.vocab_size
    warmup = random_prompts(8, args.input_len, vocab, seed=100)
    llm.generate(
        warmup, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    # Prefill alone (other random prompts, so nothing is served from the prefix cache).
    prefill_prompts = random_prompts(len(prompts), args.input_len, vocab, seed=101)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(
        prefill_prompts,
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        use_tqdm=False,
    )
    prefill_s = time.perf_counter() - start

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    steps_before = llm.engine.stats.steps
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    steps = llm.engine.stats.steps - steps_before
    generated = sum(len(o.token_ids) for o in outputs)
    emit(
        dict(
            engine="atom",
            case="throughput_detail",
            seconds=round(seconds, 3),
            steps=steps,
            prefill_only_seconds=round(prefill_s, 3),
            decode_ms_per_step_estimate=round((seconds - prefill_s) / max(1, steps - 1) * 1e3, 3),
        )
    )
    throughput = generated / seconds
    total = (generated + sum(len(p) for p in prompts)) / seconds

    if args.profile:
        profile_decode(llm, random_prompts(args.max_num_seqs, 64, vocab, seed=102))

    single_params = SamplingParams(
        temperature=0.0, max_tokens=args.batch1_output_len, ignore_eos=True
    )
    start = time.perf_counter()
    out = llm.generate([single], single_params, use_tqdm=False)[0]
    batch1 = len(out.token_ids) / (time.perf_counter() - start)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return throughput, total, batch1


def profile_decode(llm, prompts) -> None:
    """Print the top CUDA kernels and host time of 32 decode steps at full batch."""
    from torch.profiler import ProfilerActivity, profile

    from atom.sampling_params import SamplingParams

    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(32):
            engine.step()
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - start) / 32
    import cProfile
    import pstats

    host = cProfile.Profile()
    host.enable()
    for _ in range(4):
        engine.step()
    host.disable()
    while engine.has_unfinished():
        engine.step()
    pstats.Stats(host, stream=sys.stderr).sort_stats("tottime").print_stats(14)
    print(f"profiled decode step at batch {len(prompts)}: {per_step * 1e3:.3f} ms", file=sys.stderr)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--batch1-input-len", type=int, default=128)
    parser.add_argument("--batch1-output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--hf-batch-size", type=int, default=256)
    parser.add_argument("--hf-batch1-output-len", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="print a torch.profiler table of decode steps"
    )
    kernels = parser.add_argument_group("batch-1 kernels (benchmarks/decode_profile.py)")
    kernels.add_argument(
        "--profile-kernels",
        action="store_true",
        help="kernels and GPU time per batch-1 decode step, both shapes, the default fusions",
    )
    kernels.add_argument(
        "--ablate",
        action="store_true",
        help="as --profile-kernels for: every fusion off, each alone, all, the defaults",
    )
    kernels.add_argument(
        "--ablate-throughput",
        action="store_true",
        help="the throughput workload with every fusion off and with the defaults",
    )
    kernels.add_argument(
        "--shapes",
        nargs="*",
        default=None,
        help="shapes of benchmarks/model_shapes.py (llama-3.2-1b llama-3.2-3b llama-3.1-8b "
        "qwen2.5-7b smollm2-135m qwen2.5-1.5b llama-2-13b; none named: all). Alone: the "
        "batch-1 shape matrix (defaults vs all-off); with --profile-kernels / --ablate: "
        "the shapes they measure (default llama-3.2-1b smollm2-135m)",
    )
    kernels.add_argument(
        "--configs",
        nargs="*",
        default=None,
        help="with --ablate: only these labels (e.g. baseline gemv_set)",
    )
    kernels.add_argument("--profile-steps", type=int, default=30)
    kernels.add_argument("--window-steps", type=int, default=64)
    kernels.add_argument("--top-kernels", type=int, default=12)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    args.matrix = args.shapes is not None and not (
        args.profile_kernels or args.ablate or args.ablate_throughput
    )
    if args.matrix or args.profile_kernels or args.ablate or args.ablate_throughput:
        from benchmarks import decode_profile

        return decode_profile.run(args)

    import transformers

    config = transformers.LlamaConfig(**LLAMA_32_1B, architectures=["LlamaForCausalLM"])
    prompts = random_prompts(args.num_prompts, args.input_len, config.vocab_size, seed=0)
    single = random_prompts(1, args.batch1_input_len, config.vocab_size, seed=1)[0]
    shape = dict(model="llama-3.2-1b-shape", dtype="bf16", gpu=torch.cuda.get_device_name())
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        throughput, total, batch1 = atom_runs(model_dir, args, prompts, single)
    workload = dict(
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len
    )
    emit(
        dict(
            engine="atom",
            case="throughput",
            output_tok_s=round(throughput, 1),
            total_tok_s=round(total, 1),
            **workload,
            **shape,
        )
    )
    emit(
        dict(
            engine="atom",
            case="batch1_decode",
            output_tok_s=round(batch1, 1),
            output_len=args.batch1_output_len,
            **shape,
        )
    )
    if args.skip_hf:
        return 0
    hf_throughput = hf_generate_tok_s(config, prompts, args.output_len, args.hf_batch_size)
    emit(
        dict(
            engine="hf",
            case="throughput",
            output_tok_s=round(hf_throughput, 1),
            batch_size=args.hf_batch_size,
            **workload,
            **shape,
        )
    )
    hf_batch1 = hf_generate_tok_s(config, [single], args.hf_batch1_output_len, 1)
    emit(
        dict(
            engine="hf",
            case="batch1_decode",
            output_tok_s=round(hf_batch1, 1),
            output_len=args.hf_batch1_output_len,
            **shape,
        )
    )
    emit(
        dict(
            case="summary",
            throughput_ratio_vs_hf=round(throughput / hf_throughput, 2),
            batch1_ratio_vs_hf=round(batch1 / hf_batch1, 2),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

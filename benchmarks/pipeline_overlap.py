"""How busy each pipeline stage is: idle fraction per stage with M micro-batches in flight.

    python -m benchmarks.pipeline_overlap --pp 2 --micro-batches 1 4 --device cpu

A random Llama (load_format="dummy": weights drawn in the ranks, nothing on disk but the
config) on P spawned stages. Per stage, from the ranks' own counters (`rank_stats`):
`wait` = seconds blocked receiving from the previous stage / sending to the next /
waiting for the sampled tokens, `step` = seconds from a step's message to its end,
`between` = seconds waiting for the engine's next message. Idle fraction in steps =
wait / step; overall = (wait + between) / (step + between). With M = 1 the stages take
turns (idle ~ (P - 1) / P); with M micro-batches stage s computes micro-batch k while
stage s + 1 computes k - 1, so the ideal idle is (P - 1) / (M + P - 1).

Prints one JSON line per (M, stage) and one per M with the generation time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import transformers

from atom.model_engine.llm import LLM
from atom.sampling_params import SamplingParams


def tiny_llama_dir(hidden: int, layers: int, vocab: int) -> str:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    path = tempfile.mkdtemp(prefix="atom-pp-bench-")
    config.save_pretrained(path)
    return path


def measure(args, path: str, micro_batches: int) -> list[dict]:
    llm = LLM(
        path,
        device=args.device,
        load_format="dummy",
        skip_tokenizer_init=True,
        pipeline_parallel_size=args.pp,
        tensor_parallel_size=args.tp,
        num_micro_batches=micro_batches,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=256 << 20,
        async_scheduling=args.async_scheduling,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        prompt = list(range(3, 3 + args.input_len))
        prompts = [[(t + i) % 1000 + 3 for t in prompt] for i in range(args.num_prompts)]
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        runner = llm.engine.model_runner
        runner.rank_stats()  # restart the counters
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        rows = []
        for stats in runner.rank_stats():
            step, wait, between = (
                stats["step_seconds"],
                stats["wait_seconds"],
                stats["between_seconds"],
            )
            rows.append(
                {
                    "micro_batches": micro_batches,
                    "stage": stats["stage"],
                    "tp_rank": stats["tp_rank"],
                    "steps": stats["steps"],
                    "step_s": round(step, 4),
                    "wait_s": round(wait, 4),
                    "between_s": round(between, 4),
                    "idle_in_steps": round(wait / step, 3),
                    "idle_overall": round((wait + between) / (step + between), 3),
                }
            )
        rows.append(
            {
                "micro_batches": micro_batches,
                "generate_s": round(seconds, 3),
                "output_tok_s": round(args.num_prompts * args.output_len / seconds, 1),
                "ideal_idle": round((args.pp - 1) / (micro_batches + args.pp - 1), 3),
            }
        )
        return rows
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--async-scheduling", action="store_true")
    args = parser.parse_args(argv)
    path = tiny_llama_dir(args.hidden, args.layers, args.vocab)
    for micro_batches in args.micro_batches:
        for row in measure(args, path, micro_batches):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

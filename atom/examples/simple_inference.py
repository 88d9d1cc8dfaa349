"""Offline generation: `python -m atom.examples.simple_inference [--prompt ...]`.

Completions go to stdout (or one JSON object per prompt with --json); logs, the progress
bar and throughput go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from atom.config import Config
from atom.entrypoints.engine_args import add_engine_args, config_from_args
from atom.model_engine.distributed_runner import serve_node
from atom.model_engine.llm import LLM
from atom.model_engine.llm_engine import resolve_max_model_len
from atom.model_engine.rendezvous import RendezvousError
from atom.model_engine.workers import WorkerFailedError
from atom.models.default_model import default_model_path
from atom.models.loader import ModelLoadError, read_config
from atom.sampling_params import SamplingParams

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU is.",
    "List three prime numbers.",
]


def serve_this_node(config: Config) -> None:
    """Node-rank > 0: host this node's tensor-parallel ranks until node 0 stops."""
    hf_config = read_config(config.model or default_model_path())
    serve_node(config, resolve_max_model_len(config, hf_config))


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_engine_args(parser)
    prompts = parser.add_argument_group("prompts and sampling")
    prompts.add_argument(
        "--prompt", action="append", help="repeatable; default: a few built-in prompts"
    )
    prompts.add_argument("--max-tokens", type=int, default=64)
    prompts.add_argument("--temperature", type=float, default=0.0)
    prompts.add_argument("--top-p", type=float, default=1.0)
    prompts.add_argument("--top-k", type=int, default=-1)
    prompts.add_argument("--chat", action="store_true", help="apply the model's chat template")
    prompts.add_argument("--ignore-eos", action="store_true")
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    output.add_argument(
        "--profile",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="write a torch.profiler trace with ATOM:: stages "
        "(DIR, else $ATOM_TORCH_PROFILER_DIR, else ./atom_traces)",
    )
    args = parser.parse_args(argv)

    llm = None
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
        )  # --seed is the engine's global seed (Config.seed), not each request's
        config = config_from_args(args)
        if args.profile is not None:
            config.profiler_dir = args.profile or config.profiler_dir or "atom_traces"
        if config.node_rank > 0:
            serve_this_node(config)
            return 0
        llm = LLM.from_config(config)
        prompts = args.prompt or DEFAULT_PROMPTS
        inputs = (
            [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
            if args.chat
            else prompts
        )
        if args.profile is not None:
            llm.start_profile()
        start = time.perf_counter()
        outputs = llm.generate(inputs, params)
        elapsed = time.perf_counter() - start
        if args.profile is not None:
            print(f"profiler trace: {llm.stop_profile()}", file=sys.stderr)
    except (ValueError, ModelLoadError, RendezvousError, WorkerFailedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if llm is not None:
            llm.shutdown()

    for prompt, output in zip(prompts, outputs, strict=True):
        if args.json:
            print(
                json.dumps({"prompt": prompt, "text": output.text, "token_ids": output.token_ids})
            )
        else:
            print(f"\n### Prompt: {prompt}\n{output.text}")
    generated = sum(len(o.token_ids) for o in outputs)
    print(
        f"{len(outputs)} requests, {generated} tokens in {elapsed:.2f} s: "
        f"{generated / elapsed:.1f} output tok/s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Offline generation: `python -m atom.examples.simple_inference [--prompt ...]`.

Completions go to stdout (or one JSON object per prompt with --json); logs, the progress
bar and throughput go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from atom.config import Config, default_device
from atom.model_engine.distributed_runner import serve_node
from atom.model_engine.llm_engine import LLM, resolve_max_model_len
from atom.model_engine.rendezvous import RendezvousError
from atom.model_engine.workers import WorkerFailedError
from atom.models.default_model import default_model_path
from atom.models.loader import ModelLoadError
from atom.sampling_params import SamplingParams

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU is.",
    "List three prime numbers.",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by the offline script and the server."""
    parser.add_argument(
        "--model",
        default=None,
        help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--kv-cache-memory-gb", type=float, default=1.0, help="KV-cache budget on CPU"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--h2d-backend",
        choices=["direct", "packed"],
        default=None,
        help="how step metadata reaches the GPU (default: $ATOM_H2D_BACKEND or direct)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over N ranks (spawned processes; one GPU each on CUDA)",
    )
    parser.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="multi-node: address of node-rank 0, which hosts the rendezvous store",
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=0,
        help="rendezvous port; 0 (default) = any free port, single node only",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="nodes sharing the ranks")
    parser.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this node's index; node 0 runs the engine, the others only host ranks",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    return Config(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=int(args.kv_cache_memory_gb * 2**30),
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        h2d_backend=args.h2d_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        master_addr=args.master_addr,
        master_port=args.master_port,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
    )


def serve_this_node(config: Config) -> None:
    """Node-rank > 0: host this node's tensor-parallel ranks until node 0 stops."""
    from atom.models.loader import read_config

    hf_config = read_config(config.model or default_model_path())
    serve_node(config, resolve_max_model_len(config, hf_config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument(
        "--prompt", action="append", help="repeatable; default: a few built-in prompts"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    args = parser.parse_args(argv)

    llm = None
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
            seed=args.seed if args.temperature > 0 else None,
        )
        config = config_from_args(args)
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
        start = time.perf_counter()
        outputs = llm.generate(inputs, params)
        elapsed = time.perf_counter() - start
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

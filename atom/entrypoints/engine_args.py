"""Engine flags shared by the offline script and the OpenAI-compatible server.

One definition, so both entry points accept the same flags with the same defaults.
"""

from __future__ import annotations

import argparse

from atom.config import Config, default_device


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Flags that build the engine's Config, in `--help` groups: model, engine and cache,
    scheduling, parallelism, speculative decoding. `model_positional`: the model may also
    be given as the first argument (`atom serve MODEL`)."""
    model = parser.add_argument_group("model")
    engine = parser.add_argument_group("engine and cache")
    scheduling = parser.add_argument_group("scheduling")
    parallel = parser.add_argument_group("parallelism")
    speculative = parser.add_argument_group("speculative decoding")
    if model_positional:
        model.add_argument(
            "model_path", nargs="?", default=None, metavar="MODEL", help="same as --model"
        )
    model.add_argument(
        "--model",
        default=None,
        help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)",
    )
    model.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    model.add_argument(
        "--dtype",
        default="auto",
        help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16",
    )
    scheduling.add_argument("--max-model-len", type=int, default=None)
    scheduling.add_argument("--max-num-seqs", type=int, default=256)
    scheduling.add_argument("--max-num-batched-tokens", type=int, default=8192)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="KV-cache storage: auto (the model dtype) or fp8 (e4m3, per-token-per-head scales)",
    )
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument(
        "--kv-cache-memory-gb", type=float, default=1.0, help="KV-cache budget on CPU"
    )
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the engine's global random seed (a request's own seed is its SamplingParams')",
    )
    engine.add_argument(
        "--h2d-backend",
        choices=["direct", "packed"],
        default=None,
        help="how step metadata reaches the GPU (default: $ATOM_H2D_BACKEND or direct)",
    )
    parallel.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over N ranks (spawned processes; one GPU each on CUDA)",
    )
    parallel.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="split the decoder layers into P stages on their own ranks (P x TP ranks)",
    )
    parallel.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="D engine replicas, each on its own TP x PP ranks; requests go to the least loaded",
    )
    parallel.add_argument(
        "--num-micro-batches",
        type=int,
        default=None,
        help="micro-batches per step (runner slots): 1-2, or 1-8 with pipeline parallelism "
        "(default: one per pipeline stage)",
    )
    parallel.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="multi-node: address of node-rank 0, which hosts the rendezvous store",
    )
    parallel.add_argument(
        "--master-port",
        type=int,
        default=0,
        help="rendezvous port; 0 (default) = any free port, single node only",
    )
    speculative.add_argument(
        "--speculative-method",
        choices=["ngram", "draft"],
        default=None,
        help="speculative decoding: ngram (prompt lookup) or draft (--speculative-model)",
    )
    speculative.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="proposals verified per sequence and step (speculative decoding)",
    )
    speculative.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram matched")
    speculative.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched")
    speculative.add_argument(
        "--speculative-model",
        default=None,
        help="draft model for --speculative-method draft (same vocabulary as --model)",
    )
    parallel.add_argument("--nnodes", type=int, default=1, help="nodes sharing the ranks")
    parallel.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this node's index; node 0 runs the engine, the others only host ranks",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    model_path = getattr(args, "model_path", None)
    if model_path is not None and args.model is not None and model_path != args.model:
        raise ValueError(f"two models given: {model_path} and --model {args.model}; give one")
    return Config(
        model=args.model or model_path,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=int(args.kv_cache_memory_gb * 2**30),
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        h2d_backend=args.h2d_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        num_micro_batches=args.num_micro_batches,
        master_addr=args.master_addr,
        master_port=args.master_port,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        speculative_model=args.speculative_model,
    )

"""DeepSeek-V4.1 decode speed with the step's read limit (atom only: no released
transformers has V4.1).

    python -m benchmarks.deepseek_v41_decode [--context 8192] [--batches 1,64] [--steps 16]
    python -m benchmarks.deepseek_v41_decode --tiny --device cpu   # a smoke run on the CPU

The shape: the reference checkpoints' six-layer pattern (`../shared/reference/deepseek_v41/
tiny-full`: compress ratios [0, 2, 2, 1, 1, 1], KV sources 1 and 3, index sources 1, 3 and
5, the two-level top-k from layer 3) at DeepSeek-V4 benchmark widths (hidden 4096, 64 heads
of 512, q_lora 1024, o_groups 8 x o_lora 1024, 16 experts of 2048 with top-6 and a shared
expert, indexer 64 heads of 128 with top-512, window 128, vocab 129,280), random bf16
weights (`load_format="dummy"`). Engram is off: its tables are hashed through the model's
tokenizer.json (a random checkpoint has none), and a step reads only a few of their rows.
`--tiny` keeps the reference's own widths.

One JSON line per batch (`deepseek_v4_decode.atom_decode`: every sequence decoding through
the timed steps, kernels per step and layer), with the step's read (`read_mb`: the weights
at the batch's expected distinct experts; `state_mb`: per layer and sequence the window's
rows, and for a compressed layer its top-k entries and, for an index source, every
indexer key) and, on CUDA, `limit_ms` / `fraction_of_limit` against a streaming read of
the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from benchmarks.deepseek_v4_decode import atom_decode, decode_headroom, with_read_limit
from benchmarks.harness import emit

REFERENCE = os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "reference", "deepseek_v41", "tiny-full"
)

WIDE = dict(
    vocab_size=129280, hidden_size=4096, num_attention_heads=64, head_dim=512,
    qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
    n_routed_experts=16, num_experts_per_tok=6, moe_intermediate_size=2048,
    index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128,
    candidate_block_size=64, candidate_topk_blocks=16, rms_norm_eps=1e-6,
)  # fmt: skip


def v41_config(tiny: bool, max_position: int) -> dict:
    """The reference tiny-full config.json, engram off, at `WIDE` widths unless `tiny`."""
    with open(os.path.join(REFERENCE, "config.json")) as file:
        config = json.load(file)
    config.update(engram_layer_ids=[], dtype="bfloat16", max_position_embeddings=max_position,
                  bos_token_id=0, eos_token_id=1)  # fmt: skip
    if not tiny:
        config.update(WIDE)
        rotary = config["qk_rope_head_dim"] / config["head_dim"]  # 64 of 512, as V4
        for rope in config["rope_parameters"].values():
            rope["partial_rotary_factor"] = rotary
    return config


def v41_state_read(llm, config: dict, batch: int, context: int) -> float:
    """KV bytes a decode step reads, from the shape (the cache's element size): per layer
    and sequence the window's rows; a compressed layer's top-k entries (its own or its KV
    source's); an index source's indexer keys over the compressed context."""
    itemsize = llm.engine.model_runner._kv_cache_dtype().itemsize
    head_dim, rows = config["head_dim"], 0
    index_sources = set(config["index_source_layer_ids"])
    for layer, ratio in enumerate(config["compress_ratios"]):
        rows += min(context, config["sliding_window"]) * head_dim
        if ratio:
            entries = context // ratio
            rows += min(config["index_topk"], entries) * head_dim
            if layer in index_sources:
                rows += entries * config["index_head_dim"]
    return batch * rows * itemsize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tiny", action="store_true", help="the reference checkpoint's widths")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--prefill-tokens", type=int, default=1024,
                        help="prompt tokens a step (chunked prefill): V4.1's torch prefill "
                             "holds every query's keys, 128 GiB for one 8K chunk")  # fmt: skip
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(REFERENCE, "config.json")):
        parser.error(f"needs the V4.1 reference data beside the checkout ({REFERENCE})")
    from atom.model_engine.llm import LLM

    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.context + decode_headroom(max(batches), args.steps) + 16
    config = v41_config(args.tiny, max_len)
    stream_read = None
    if args.device == "cuda":
        from benchmarks.harness import streaming_bandwidth

        stream_read = streaming_bandwidth()["stream_read"]
        emit(dict(case="stream_read", gb_s=round(stream_read / 1e9, 1)))
    with tempfile.TemporaryDirectory() as path:
        with open(os.path.join(path, "config.json"), "w") as file:
            json.dump(config, file)
        options = dict(
            skip_tokenizer_init=True, load_format="dummy", max_model_len=max_len,
            max_num_seqs=max(batches), max_num_batched_tokens=min(args.context, args.prefill_tokens), device=args.device,
        )  # fmt: skip
        if args.device == "cuda":
            options.update(dtype="bfloat16", gpu_memory_utilization=args.gpu_memory_utilization,
                           cuda_graph_batch_sizes=sorted(set(batches)))  # fmt: skip
        else:
            options.update(dtype="float32", enforce_eager=True)
        llm = LLM(path, **options)
        for batch in batches:
            record = atom_decode(llm, batch, args.context, args.steps, config["vocab_size"])
            emit(with_read_limit(record, llm, config, stream_read, v41_state_read))
        llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

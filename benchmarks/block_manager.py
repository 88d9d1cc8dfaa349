"""Block bookkeeping at H200 scale: BlockManager set-up time and host bytes per block.

    python -m benchmarks.block_manager                 # CPU: 32.7M blocks
    python -m benchmarks.block_manager --startup       # + time LLM() of a tiny model

A tiny model on the H200 at the default 0.9 memory utilisation gets ~32.7M KV blocks.
`construct` times `BlockManager(num_blocks)` and measures its host memory with
tracemalloc (numpy reports its buffers there) and as resident-set growth; `churn` then
admits, grows and frees a batch of sequences so the first pages are really touched.
`--startup` saves a tiny random Llama (2 layers, hidden 64; or takes --model) and times
`LLM()` over it at the defaults (CUDA: 0.9 GPU memory utilisation), after a warm-up
`LLM()` that pays the CUDA context and Triton compilations; it prints the block count.
Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import tracemalloc

from atom.model_engine.block_manager import BlockManager
from atom.model_engine.sequence import Sequence
from atom.sampling_params import SamplingParams

H200_TINY_MODEL_BLOCKS = 32_700_000


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_construction(num_blocks: int, block_size: int = 16) -> dict:
    """Time and host bytes of `BlockManager(num_blocks)`; the manager is discarded."""
    rss_before = _rss_bytes()
    tracemalloc.start()
    start = time.perf_counter()
    manager = BlockManager(num_blocks, block_size)
    seconds = time.perf_counter() - start
    traced, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    record = {
        "what": "construct",
        "num_blocks": num_blocks,
        "seconds": seconds,
        "traced_bytes_per_block": traced / num_blocks,
        "array_bytes_per_block": manager.bookkeeping_bytes / num_blocks,
        "resident_bytes_per_block": (_rss_bytes() - rss_before) / num_blocks,
    }
    record.update(measure_churn(manager))
    return record


def measure_churn(manager: BlockManager, num_seqs: int = 256, tokens: int = 2048) -> dict:
    """Admit, grow and free `num_seqs` sequences of `tokens` tokens (prefix cache on)."""
    params = SamplingParams(max_tokens=1)
    seqs = [Sequence(list(range(i, i + tokens)), params) for i in range(num_seqs)]
    start = time.perf_counter()
    for seq in seqs:
        manager.admit(seq, manager.find_prefix(seq))
        manager.grow(seq, tokens)
        seq.num_computed_tokens = tokens
        manager.register_computed(seq)
    for seq in seqs:
        manager.free(seq)
    seconds = time.perf_counter() - start
    assert manager.num_free_blocks == manager.num_blocks
    blocks = num_seqs * manager.blocks_for(tokens)
    return {"churn_blocks": blocks, "churn_us_per_block": seconds / blocks * 1e6}


def measure_startup(device: str, model_path: str | None = None) -> dict:
    """Wall time of `LLM()` over a tiny random Llama at the defaults, after a warm-up
    `LLM()` with 1024 blocks (CUDA context, Triton compilations) timed separately."""
    import torch
    import transformers

    from atom.model_engine.llm import LLM

    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path
        if path is None:
            path = tmp
            torch.manual_seed(0)
            transformers.LlamaForCausalLM(config).save_pretrained(path)
        start = time.perf_counter()
        LLM(path, device=device, skip_tokenizer_init=True, num_kvcache_blocks=1024).shutdown()
        warm_up_seconds = time.perf_counter() - start
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        start = time.perf_counter()
        llm = LLM(path, device=device, skip_tokenizer_init=True)
        seconds = time.perf_counter() - start
        manager = llm.engine.block_manager
        record = {
            "what": "LLM() startup at the defaults",
            "device": device,
            "seconds": seconds,
            "warm_up_seconds": warm_up_seconds,
            "num_blocks": manager.num_blocks,
            "array_bytes_per_block": manager.bookkeeping_bytes / manager.num_blocks,
        }
        llm.shutdown()
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=H200_TINY_MODEL_BLOCKS)
    parser.add_argument("--startup", action="store_true", help="also time LLM() (tiny model)")
    parser.add_argument("--device", default=None, help="for --startup; default: cuda if present")
    parser.add_argument("--model", default=None, help="for --startup; default: a tiny random Llama")
    args = parser.parse_args(argv)
    print(json.dumps(measure_construction(args.num_blocks)), flush=True)
    if args.startup:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        print(json.dumps(measure_startup(device, args.model)), flush=True)


if __name__ == "__main__":
    main()

"""Qwen3-Next decode speed, atom beside HF transformers in one run, and state bytes.

    python -m benchmarks.qwen3_next_decode [--layers 4] [--context 8192]
        [--batches 1,64] [--steps 32] [--skip-hf]
        [--moe-gemv on off | --shared-pair on off | --pdl-chain on off]
        [--attn-split-cap 32 128]

Random bf16 weights in a Qwen3-Next-80B-A3B shape with few layers (hidden 2048, GDN with 16
k heads / 32 v heads of 128, conv 4; gated attention 16 heads / 2 KV heads of 256 every
4th layer; 64 experts of 512, top 10, shared expert), saved once with HF's `save_pretrained`
so both engines read the same weights. One JSON line each:
- `state_bytes`: the per-sequence GDN state (conv + delta-rule, fp32) and the KV bytes of
  the full-attention layers at `--kv-context`, beside an all-attention KV cache (every
  layer full attention with the same heads) at that context;
- `decode` per engine and batch: output tok/s of decode steps over `--context`-token
  prompts (atom: engine steps after every prefill is done, CUDA graphs; HF: its forward
  with its own cache, one sequence prefilled and its cache repeated over the batch, greedy
  argmax per step);
- `logits`: atom bf16 greedy tokens against HF fp32 on the same weights: the largest gap
  between HF's best logit and the chosen token's, relative to the largest |logit|.

`--moe-gemv on off [auto]` (atom only): one engine per MoE decode path
(`moe.DECODE_GEMV_OVERRIDE`: the per-pair GEMV, the grouped GEMMs, or the rule's choice),
a `decode` line per batch each and a `moe_gemv_summary` line. `--moe-align ONE_HOT,WARPS`
fixes the align kernel's geometry (the grouped path's) for every run. `--shared-pair on
off` (atom only): one engine with the shared expert as one more pair of the per-pair GEMV
(`moe.SHARED_PAIR`), one with its own launches; `--pdl-chain on off` likewise for the MoE /
GDN chain's small kernels under PDL (`pdl.CHAIN`).
`--attn-split-cap 32 128` (atom only): one engine per split cap of the full-attention
layers' paged decode (`decode_attention.MAX_SPLITS`, the merge kernel's tile): with 2 KV
heads the default cap of 32 gives 64 programs at batch 1.
"""

from __future__ import annotations

import argparse
import gc
import tempfile

import torch

from benchmarks.deepseek_v4_decode import (
    add_switch_options,
    any_switch,
    atom_decode,
    decode_by_switch,
    decode_headroom,
    decode_per_setting,
    emit,
    logits_gap,
    with_read_limit,
)
from benchmarks.harness import streaming_bandwidth


def qwen3_next_shape(layers: int, max_position: int) -> dict:
    return dict(
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=layers,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ],
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        intermediate_size=5120,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=64,
        num_experts_per_tok=10,
        max_position_embeddings=max_position,
        bos_token_id=0,
        eos_token_id=1,
    )


def save_random_model(path: str, shape: dict):
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(**shape)
    with torch.device("cuda"):
        model = transformers.Qwen3NextForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():  # HF initialises the router to zero: make the choice matter
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.02)
    model.save_pretrained(path)
    return model


def state_bytes(llm, context: int, shape: dict) -> dict:
    from atom.model_engine import state_slots

    runner = llm.engine.model_runner
    contract = runner.family.state_contract(runner.model, runner._kv_cache_dtype())
    per_sequence = state_slots.state_bytes(contract, 1) / 2  # one slot (+ scratch)
    itemsize = runner._kv_cache_dtype().itemsize
    per_token_full = 2 * shape["num_key_value_heads"] * shape["head_dim"] * itemsize
    full_layers = len(runner.model.attention_layers)
    hybrid = per_sequence + full_layers * per_token_full * context
    all_attention = shape["num_hidden_layers"] * per_token_full * context
    return dict(
        case="state_bytes",
        context=context,
        gdn_layers=len(runner.model.state_layers),
        full_attention_layers=full_layers,
        gdn_state_per_sequence_bytes=int(per_sequence),
        hybrid_per_sequence_bytes=int(hybrid),
        all_attention_kv_per_sequence_bytes=int(all_attention),
        ratio_all_attention_over_hybrid=round(all_attention / hybrid, 2),
    )


def gdn_state_read(llm, shape: dict, batch: int, context: int) -> float:
    """State bytes a Qwen3-Next decode step moves per the shape: each sequence's GDN state
    (conv + delta rule) read and written back, and the full-attention layers' K and V of
    the whole context read."""
    from atom.model_engine import state_slots

    runner = llm.engine.model_runner
    contract = runner.family.state_contract(runner.model, runner._kv_cache_dtype())
    gdn = state_slots.state_bytes(contract, 1) / 2  # one slot (+ scratch)
    itemsize = runner._kv_cache_dtype().itemsize
    per_token = 2 * shape["num_key_value_heads"] * shape["head_dim"] * itemsize
    full = len(runner.model.attention_layers) * per_token * context
    return batch * (2 * gdn + full)


def repeat_cache(cache, batch: int):
    """HF's cache of one sequence repeated `batch` times (every batch-1 tensor it holds)."""

    def repeat(value):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 1:
            return value.repeat(batch, *[1] * (value.dim() - 1))
        if isinstance(value, list):
            return [repeat(v) for v in value]
        if isinstance(value, dict):
            return {k: repeat(v) for k, v in value.items()}
        return value

    holders = list(getattr(cache, "layers", None) or []) + [cache]
    for holder in holders:
        for name, value in list(vars(holder).items()):
            if name != "layers":
                setattr(holder, name, repeat(value))
    return cache


def hf_decode(model, batch: int, context: int, steps: int, vocab: int) -> dict:
    import time

    generator = torch.Generator().manual_seed(batch)
    prompt = torch.randint(2, vocab, (1, context), generator=generator).cuda()
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        cache = repeat_cache(out.past_key_values, batch)
        tokens = out.logits[:, -1].argmax(-1).repeat(batch)[:, None]
        for i in range(steps + 3):
            if i == 3:
                torch.cuda.synchronize()
                start = time.perf_counter()
            out = model(input_ids=tokens, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            tokens = out.logits[:, -1].argmax(-1)[:, None]
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return dict(case="decode", engine="hf", batch=batch, context=context,
                tok_s=round(batch * steps / seconds, 1), ms_per_step=round(seconds / steps * 1e3, 3))  # fmt: skip


def decode_by_split_cap(path: str, args, batches: list[int], vocab: int, max_len: int) -> None:
    """One engine per `--attn-split-cap` value (its graphs captured with it)."""
    from atom.kernels import decode_attention

    default = decode_attention.MAX_SPLITS

    def setup(value: int) -> int:
        decode_attention.MAX_SPLITS = value
        return max_len

    try:
        decode_per_setting(path, args, batches, vocab, args.attn_split_cap, "attn_split_cap",
                           setup, gdn_state_read)  # fmt: skip
    finally:
        decode_attention.MAX_SPLITS = default


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--kv-context", type=int, default=65536)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument(
        "--moe-align", default=None, metavar="ONE_HOT,WARPS",
        help="a fixed geometry of the MoE align kernel (moe.ALIGN_OVERRIDE) for an A/B",
    )  # fmt: skip
    add_switch_options(parser)
    parser.add_argument(
        "--attn-split-cap", nargs="+", type=int, default=None, metavar="CAP",
        help="atom only: one engine per paged-decode split cap (powers of 2), e.g. 32 128",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.moe_align:
        from atom.kernels import moe

        moe.ALIGN_OVERRIDE = tuple(int(v) for v in args.moe_align.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    from atom.model_engine.llm import LLM

    max_len = args.context + decode_headroom(max(batches), args.steps) + 16
    shape = qwen3_next_shape(args.layers, max(args.kv_context, max_len))
    vocab = shape["vocab_size"]
    stream_read = streaming_bandwidth()["stream_read"]  # the roofline, in this run
    emit(dict(case="stream_read", gb_s=round(stream_read / 1e9, 1)))
    args.shape, args.stream_read = shape, stream_read
    results = {}
    with tempfile.TemporaryDirectory() as path:
        hf_model = save_random_model(path, shape)
        if args.attn_split_cap or any_switch(args):  # atom only: one engine per setting
            del hf_model
            gc.collect()
            torch.cuda.empty_cache()
            if args.attn_split_cap:
                decode_by_split_cap(path, args, batches, vocab, max_len)
            else:
                decode_by_switch(path, args, batches, vocab, max_len, gdn_state_read)
            return 0
        if not args.skip_hf:  # before atom sizes its cache from the free memory
            for batch in batches:
                record = hf_decode(hf_model, batch, args.context, args.steps, vocab)
                results[("hf", batch)] = record["tok_s"]
                emit(record)
                gc.collect()
                torch.cuda.empty_cache()
        del hf_model
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(
            path,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=max_len,
            max_num_seqs=max(batches),
            max_num_batched_tokens=args.context,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cuda_graph_batch_sizes=sorted(set(batches)),
        )
        emit(state_bytes(llm, args.kv_context, shape))
        for batch in batches:
            record = atom_decode(llm, batch, args.context, args.steps, vocab)
            results[("atom", batch)] = record["tok_s"]
            emit(with_read_limit(record, llm, shape, stream_read, gdn_state_read))
        if not args.skip_hf:
            emit(logits_gap(llm, path, vocab))
            speedup = {str(b): round(results[("atom", b)] / results[("hf", b)], 2) for b in batches}
            emit(dict(case="summary", speedup_atom_over_hf=speedup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

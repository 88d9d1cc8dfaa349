"""DeepSeek-V4 decode speed, atom beside HF transformers in one run, and KV bytes per pool.

    python -m benchmarks.deepseek_v4_decode [--layers 4] [--context 8192]
        [--batches 1,64] [--steps 32] [--skip-hf] [--max-model-lens 8320 65536 1048576]
        [--decode-splits auto 1] [--moe-gemv on off | --shared-pair on off | --pdl-chain on off]

Random bf16 weights in a V4 shape with few layers (hidden 4096, 64 heads, head_dim 512,
window 128, CSA 4 / HCA 128, index_topk 512, 16 experts), saved once with HF's
`save_pretrained` so both engines read the same weights. Needs transformers with
DeepseekV4 (>= 5.24; carry the wheel when the machine's is older). One JSON line each:
- `kv_bytes`: bytes per token of each pool at 64K context (CSA entries, CSA indexer keys,
  HCA entries, the per-sequence state (window rings + compressor rows) spread over the
  context) beside a full-attention cache of the same head shape (one shared K=V head of
  head_dim, and separate K and V);
- `decode` per engine and batch: output tok/s of decode steps over `--context`-token
  prompts (atom: engine steps after every prefill is done, CUDA graphs, beside the CUDA
  kernels of one step and per layer from torch.profiler's kernel list; HF: its forward
  with its own cache, one sequence prefilled and its cache repeated over the batch, greedy
  argmax per step);
- `logits`: atom bf16 greedy tokens against HF fp32 on the same weights: the largest gap
  between HF's best logit and the chosen token's, relative to the largest |logit|.

`--max-model-lens A B ...` (atom only, no HF): one engine per `max_model_len`, each timing
decode steps at the same `--context`, one `decode` line each (with its `max_model_len`) and
a `max_model_len_summary` line (each step time over the first's). Decode work follows the
sequence, not `max_model_len` (docs/architecture.md, "DeepSeek-V4"), so the step times
should agree: issue 32's "a 64K and a 1M max_model_len give the same step time".

`--decode-splits auto 1 ...` (atom only): one engine per value of the decode attention's
key splits (`v4_attention.SPLITS_OVERRIDE`; `auto`: the engine's own choice), each timed at
every batch, in one run: the A/B of the split decode kernel.

`--moe-gemv on off [auto]` (atom only): the same, one engine per MoE decode path
(`moe.DECODE_GEMV_OVERRIDE`: the per-pair GEMV, the grouped GEMMs, or the rule's choice).
`--shared-pair on off`: one engine with the shared expert as one more pair of the per-pair
decode GEMV (`moe.SHARED_PAIR`), one with its own launches. `--pdl-chain on off`: one
engine with the MoE / GDN decode chain's small kernels under PDL (`pdl.CHAIN`), one without.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import torch

from benchmarks.harness import decode_weight_bytes, emit, read_limit, streaming_bandwidth

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def v4_shape(layers: int, max_position: int) -> dict:
    return dict(
        vocab_size=129280,
        hidden_size=4096,
        moe_intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=64,
        head_dim=512,
        q_lora_rank=1024,
        num_experts_per_tok=6,
        n_routed_experts=16,
        layer_types=[CSA if i % 2 == 0 else HCA for i in range(layers)],
        mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1),
        compress_rates={CSA: 4, HCA: 128},
        sliding_window=128,
        o_groups=8,
        o_lora_rank=1024,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        max_position_embeddings=max_position,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 65536,
        },
        bos_token_id=0,
        eos_token_id=1,
    )


def save_random_model(path: str, shape: dict):
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(**shape)
    with torch.device("cuda"):
        model = transformers.DeepseekV4ForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():  # the parameters HF initialises to zero, so they matter here
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                buffer.copy_(torch.randint(0, config.n_routed_experts, buffer.shape))
    model.save_pretrained(path)
    return model


def kv_bytes(llm, context: int, shape: dict) -> dict:
    from atom.model_engine import state_slots

    runner = llm.engine.model_runner
    layers, block_size = runner.model.attention_layers, runner.block_size
    itemsize = runner._kv_cache_dtype().itemsize
    pools = {}
    for index, layer in enumerate(layers):
        shapes = layer.pool_shapes(block_size)  # (rows, width) of a block, as allocated
        kind = "csa" if layer.overlap else "hca"
        if "pool" in shapes:
            rows, width = shapes["pool"]
            pools[f"layer{index}_{kind}_entries"] = rows * width * itemsize / block_size
        if "index_pool" in shapes:
            rows, width = shapes["index_pool"]
            pools[f"layer{index}_csa_index_keys"] = rows * width * itemsize / block_size
    contract = runner.family.state_contract(runner.model, runner._kv_cache_dtype())
    state = state_slots.state_bytes(contract, 1) / 2  # one slot (+ scratch)
    pools["state_per_sequence_bytes"] = state
    pools["state_spread_over_context"] = state / context
    total = sum(v for k, v in pools.items() if k.startswith("layer")) + state / context
    head_dim = shape["head_dim"]
    shared_kv = len(layers) * head_dim * itemsize
    return dict(
        case="kv_bytes",
        context=context,
        block_size=block_size,
        per_token=pools,
        v4_total_per_token=round(total, 2),
        full_attention_shared_kv_per_token=shared_kv,
        full_attention_k_and_v_per_token=2 * shared_kv,
        ratio_vs_shared_kv=round(shared_kv / total, 2),
    )


def build_engine(path: str, max_len: int, batches: list[int], context: int, memory: float):
    from atom.model_engine.llm import LLM

    return LLM(
        path,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=max_len,
        max_num_seqs=max(batches),
        max_num_batched_tokens=context,
        gpu_memory_utilization=memory,
        cuda_graph_batch_sizes=sorted(set(batches)),
    )


def decode_per_setting(path: str, args, batches: list[int], vocab: int, settings: list,
                       label: str, setup, state_read=None) -> None:  # fmt: skip
    """One engine per value of `settings` (`setup(value)` applies it and returns the
    engine's max_model_len), decode steps at `--context` each: a `decode` line per batch
    with `label`, then a `<label>_summary` line (each step time over the first value's).
    `state_read`: the family's state bytes a step reads (V4's by default)."""
    state_read = state_read or v4_state_read
    times = {}
    for value in settings:
        max_len = setup(value)
        llm = build_engine(path, max_len, batches, args.context, args.gpu_memory_utilization)
        for batch in batches:
            record = atom_decode(llm, batch, args.context, args.steps, vocab)
            times[(batch, value)] = record["ms_per_step"]
            record = with_read_limit(record, llm, args.shape, args.stream_read, state_read)
            emit(dict(record, **{label: value}))
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    first = settings[0]
    emit(dict(case=f"{label}_summary", context=args.context,
              ms_per_step_over_first={str(b): {str(v): round(times[(b, v)] / times[(b, first)], 3)
                                               for v in settings} for b in batches}))  # fmt: skip


def v4_state_read(llm, shape: dict, batch: int, context: int) -> float:
    """KV bytes a V4 decode step reads, from the shape: per layer and sequence the window's
    rows, and the CSA layers' top-k entries and every indexer key, or the HCA layers' every
    entry (the cache's element size)."""
    runner = llm.engine.model_runner
    itemsize = runner._kv_cache_dtype().itemsize
    head_dim, rows = shape["head_dim"], 0
    for kind in shape["layer_types"]:
        rows_window = min(context, shape["sliding_window"]) * head_dim
        ratio = shape["compress_rates"][kind]
        if kind == CSA:
            entries = context // ratio
            rows += rows_window + min(shape["index_topk"], entries) * head_dim
            rows += entries * shape["index_head_dim"]
        else:
            rows += rows_window + (context // ratio) * head_dim
    return batch * rows * itemsize


def with_read_limit(record: dict, llm, shape: dict, stream_read: float | None, state_read) -> dict:
    """`record` (an atom decode line) with the step's read (the weights it reads at its
    batch and `state_read(llm, shape, batch, context)`) and its fraction of the read limit."""
    model = llm.engine.model_runner.model
    top_k = shape.get("num_experts_per_tok", 1)
    experts = shape.get("n_routed_experts") or shape.get("num_experts") or 1
    weights = decode_weight_bytes(model, record["batch"], top_k, experts)
    state = state_read(llm, shape, record["batch"], record["context"])
    limit = read_limit(weights, state, stream_read)
    if "limit_ms" in limit:
        limit["fraction_of_limit"] = round(limit["limit_ms"] / record["ms_per_step"], 3)
    return dict(record, **limit)


def decode_headroom(batch: int, steps: int) -> int:
    """Tokens a sequence may generate in `atom_decode`: its decodes while the later prompts
    prefill (at most two steps each: the budget is one context less the decodes), the
    warm-up, the timed and the profiled steps, and a margin."""
    return 2 * batch + steps + PROFILED_STEPS + 16


def atom_decode(llm, batch: int, context: int, steps: int, vocab: int) -> dict:
    """Decode steps of `batch` sequences at `context` tokens. The scheduler runs decodes
    beside later prompts' prefills, so the first sequences are already decoding while the
    last prefill: each may generate `decode_headroom` tokens, so that all `batch` are still
    running through the timed and profiled steps (checked), and they are aborted after."""
    from atom.sampling_params import SamplingParams

    engine = llm.engine
    cuda = engine.model_runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    generator = torch.Generator().manual_seed(batch)
    prompts = torch.randint(2, vocab, (batch, context), generator=generator).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=decode_headroom(batch, steps),
                            ignore_eos=True)  # fmt: skip
    seq_ids = [engine.add_request(prompt, params) for prompt in prompts]
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # warm-up decode steps
        engine.step()
    running = len(engine.scheduler.running)
    if running != batch:
        raise RuntimeError(f"{running} of {batch} sequences decoding: raise decode_headroom")
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    seconds = time.perf_counter() - start
    kernels = kernels_per_step(engine, PROFILED_STEPS) if cuda else None
    if not cuda:  # the profiled steps' tokens, so that the check below sees the same steps
        for _ in range(PROFILED_STEPS):
            engine.step()
    if len(engine.scheduler.running) != batch:
        raise RuntimeError("a sequence finished before the profiled steps: raise decode_headroom")
    for seq_id in seq_ids:
        engine.abort(seq_id)
    while engine.has_unfinished():
        engine.step()
    layers = len(engine.model_runner.model.model.layers)
    return dict(case="decode", engine="atom", batch=batch, context=context,
                tok_s=round(batch * steps / seconds, 1), ms_per_step=round(seconds / steps * 1e3, 3),
                kernels_per_step=kernels,
                kernels_per_layer=None if kernels is None else round(kernels / layers, 1))  # fmt: skip


PROFILED_STEPS = 4


TOP_KERNELS = 20


def kernels_per_step(engine, steps: int) -> float:
    """CUDA kernels of one decode step over `steps` steps (decode_profile.kernel_profile,
    copies and memsets not counted; its costliest kernels printed). Per layer: over the
    layers, the LM head, sampler and embedding included."""
    from benchmarks.decode_profile import kernel_profile, print_top_kernels

    record = kernel_profile(engine, steps, TOP_KERNELS)
    model = type(getattr(getattr(engine, "model_runner", None), "model", None)).__name__
    print_top_kernels(f"batch {len(engine.scheduler.running)}", dict(record, model=model))
    if os.environ.get("ATOM_BENCH_STEP_KERNELS") == "1":  # every kernel of one step, in order
        for name, us in record["first_step"]:
            print(f"    step kernel {us:8.1f} us  {name}", file=sys.stderr)
    return record["kernels_per_step"]


def repeat_cache(cache, batch: int):
    """HF's V4 cache of one sequence repeated `batch` times along the batch dimension."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor):
                setattr(layer, name, value.repeat(batch, *[1] * (value.dim() - 1)))
        for attr in ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate"):
            states = getattr(layer, attr, None) or {}
            for key, value in states.items():
                if isinstance(value, torch.Tensor):
                    states[key] = value.repeat(batch, *[1] * (value.dim() - 1))
    return cache


def hf_decode(model, batch: int, context: int, steps: int, vocab: int) -> dict:
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(batch)
    prompt = torch.randint(2, vocab, (1, context), generator=generator).cuda()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits
        cache = repeat_cache(cache, batch)
        tokens = logits[:, -1].argmax(-1).repeat(batch)[:, None]
        for i in range(steps + 3):
            if i == 3:
                torch.cuda.synchronize()
                start = time.perf_counter()
            logits = model(input_ids=tokens, cache=cache, use_cache=True).logits
            tokens = logits[:, -1].argmax(-1)[:, None]
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return dict(case="decode", engine="hf", batch=batch, context=context,
                tok_s=round(batch * steps / seconds, 1), ms_per_step=round(seconds / steps * 1e3, 3))  # fmt: skip


def logits_gap(llm, path: str, vocab: int, prompt_len: int = 600, new_tokens: int = 8) -> dict:
    import transformers

    from atom.sampling_params import SamplingParams

    prompt = torch.randint(2, vocab, (prompt_len,), generator=torch.Generator().manual_seed(7))
    prompt = prompt.tolist()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    generated = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf = hf.cuda().eval()
    with torch.inference_mode():
        full = torch.tensor([prompt + generated], device="cuda")
        logits = hf(full).logits[0, prompt_len - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(generated, device="cuda")[:, None])[:, 0]
    gap = (logits.max(dim=-1).values - chosen).max().item()
    scale = logits.abs().max().item()
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return dict(case="logits", prompt_len=prompt_len, new_tokens=new_tokens,
                max_gap=round(gap, 5), max_abs_logit=round(scale, 4),
                relative_gap=round(gap / scale, 5))  # fmt: skip


def decode_by_splits(path: str, args, batches: list[int], vocab: int, max_len: int) -> None:
    """One engine per `--decode-splits` value (its graphs captured with it)."""
    from atom.kernels import v4_attention

    def setup(value: str) -> int:
        v4_attention.SPLITS_OVERRIDE = None if value == "auto" else int(value)
        return max_len

    try:
        decode_per_setting(path, args, batches, vocab, args.decode_splits, "decode_splits", setup)
    finally:
        v4_attention.SPLITS_OVERRIDE = None


# the decode A/B switches (atom only): option -> (module, attribute, value per choice)
SWITCHES = {
    # the routed experts' decode path: per-pair GEMV, grouped GEMMs, or the rule's choice
    "moe_gemv": (
        "atom.kernels.moe",
        "DECODE_GEMV_OVERRIDE",
        {"on": True, "off": False, "auto": None},
    ),
    # the shared expert as one more pair of the per-pair GEMV, or its own launches
    "shared_pair": ("atom.kernels.moe", "SHARED_PAIR", {"on": True, "off": False}),
    # the MoE / GDN chain's small kernels under PDL, or launched without it
    "pdl_chain": ("atom.kernels.pdl", "CHAIN", {"on": True, "off": False}),
}
SWITCH_HELP = {
    "moe_gemv": "one engine per MoE decode path (on: per-pair GEMV, off: grouped GEMMs, "
    "auto: the rule), e.g. `--moe-gemv on off`",
    "shared_pair": "one engine with the shared expert as one more pair of the per-pair decode "
    "GEMV (on), one with its own launches (off)",
    "pdl_chain": "one engine with the MoE / GDN decode chain's small kernels under PDL (on), "
    "one without (off)",
}


def decode_by_switch(path: str, args, batches: list[int], vocab: int, max_len: int,
                     state_read=None) -> None:  # fmt: skip
    """One engine per value of the switch given (`--moe-gemv`, `--shared-pair` or
    `--pdl-chain`; its graphs captured with it), the module attribute restored after."""
    import importlib

    label = next(name for name in SWITCHES if getattr(args, name, None))
    module_name, attribute, choices = SWITCHES[label]
    module = importlib.import_module(module_name)
    default = getattr(module, attribute)

    def setup(value: str) -> int:
        setattr(module, attribute, choices[value])
        return max_len

    try:
        decode_per_setting(path, args, batches, vocab, getattr(args, label), label, setup,
                           state_read)  # fmt: skip
    finally:
        setattr(module, attribute, default)


def add_switch_options(parser: argparse.ArgumentParser) -> None:
    """`--moe-gemv`, `--shared-pair`, `--pdl-chain`: one engine per value (atom only)."""
    group = parser.add_mutually_exclusive_group()
    for name, (_, _, choices) in SWITCHES.items():
        group.add_argument(
            "--" + name.replace("_", "-"), nargs="+", default=None, choices=list(choices),
            help="atom only: " + SWITCH_HELP[name],
        )  # fmt: skip


def any_switch(args) -> bool:
    return any(getattr(args, name, None) for name in SWITCHES)


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
        "--max-model-lens", type=int, nargs="+", default=None,
        help="atom only: decode at --context once per max_model_len (e.g. 8320 65536 1048576)",
    )  # fmt: skip
    parser.add_argument(
        "--decode-splits", nargs="+", default=None,
        help="atom only: one engine per decode-attention split count (auto or an integer)",
    )  # fmt: skip
    add_switch_options(parser)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.context + decode_headroom(max(batches), args.steps) + 16
    if args.max_model_lens and min(args.max_model_lens) < max_len:
        parser.error(
            f"--max-model-lens must be >= --context + 2 x batch + --steps + 36 = {max_len}"
        )
    longest = max([args.kv_context, max_len, *(args.max_model_lens or [])])
    shape = v4_shape(args.layers, longest)
    vocab = shape["vocab_size"]
    # the streaming read every step is compared against, measured in this run
    stream_read = args.stream_read = streaming_bandwidth()["stream_read"]
    emit(dict(case="stream_read", gb_s=round(stream_read / 1e9, 1)))
    args.shape = shape
    results = {}
    with tempfile.TemporaryDirectory() as path:
        hf_model = save_random_model(path, shape)
        if args.max_model_lens:
            del hf_model
            gc.collect()
            torch.cuda.empty_cache()
            decode_per_setting(path, args, batches, vocab, args.max_model_lens,
                               "max_model_len", lambda max_model_len: max_model_len)  # fmt: skip
            return 0
        if args.decode_splits:
            del hf_model
            gc.collect()
            torch.cuda.empty_cache()
            decode_by_splits(path, args, batches, vocab, max_len)
            return 0
        if any_switch(args):
            del hf_model
            gc.collect()
            torch.cuda.empty_cache()
            decode_by_switch(path, args, batches, vocab, max_len)
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
        llm = build_engine(path, max_len, batches, args.context, args.gpu_memory_utilization)
        emit(kv_bytes(llm, args.kv_context, shape))
        for batch in batches:
            record = atom_decode(llm, batch, args.context, args.steps, vocab)
            results[("atom", batch)] = record["tok_s"]
            emit(with_read_limit(record, llm, shape, stream_read, v4_state_read))
        if not args.skip_hf:
            emit(logits_gap(llm, path, vocab))
            speedup = {str(b): round(results[("atom", b)] / results[("hf", b)], 2) for b in batches}
            emit(dict(case="summary", speedup_atom_over_hf=speedup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

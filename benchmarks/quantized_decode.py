"""Quantized weights against bf16: batch-1 decode, the GEMVs per layer, and throughput.

    python -m benchmarks.quantized_decode                          # batch-1: bf16 / fp8 / int4
    python -m benchmarks.quantized_decode --shape llama-3.1-70b --formats fp8
    python -m benchmarks.quantized_decode --kernels                # per layer shape, 1 and 16 rows
    python -m benchmarks.quantized_decode --throughput             # 256 prompts: bf16 vs fp8

Random weights in a real model shape (benchmarks/model_shapes.py; default Llama-3.1-8B).
bf16 runs the engine's own random weights (`load_format="dummy"`). A quantized format is
built as a checkpoint is: random bf16 weights quantized into the checkpoint's tensors
(compressed-tensors FP8_DYNAMIC: fp8 e4m3 with one bf16 scale per output row and dynamic
per-token activations; W4A16: int4 `weight_packed` words with bf16 group-128 scales, as
llm-compressor writes them), with the config's `quantization_config`, then loaded by the
engine through the quantization package (QuantizedWeightStream, the linear methods). The
tensors go from memory into the loader's shard reader instead of through safetensors files
(the 70B shape's ~70 GB would not fit the disk): everything after the file read is the
real path.

Batch-1 decode: CUDA graphs of batch 1, a 128-token prompt, the median of three windows of
decode steps; each format's tok/s, its ratio to bf16, and the weight-read limit (the bytes a
step reads: every weight but the embedding table, scales included, over a streaming read
measured in the same run). `--kernels`: each linear layer shape of the model, the FP8
(per-row and 128x128 block scales) and int4 (group 128) kernels against bf16 cuBLAS
(F.linear), device time from a CUDA graph with the L2 flushed before each call.
`--throughput`: offline throughput of 256 random prompts, bf16 against FP8 (tensor cores
above 16 rows). One JSON line per measurement on stdout, a table on stderr; a format that
fails prints its error and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks.harness import emit

FORMATS = ("bf16", "fp8", "int4")
# a toy Llama for the CPU smoke test (benchmarks/tests/test_quantized_decode.py)
TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
INT4_GROUP = 128


def hf_config(shape: str):
    import transformers

    if shape == "tiny":
        return transformers.AutoConfig.for_model(
            "llama", architectures=["LlamaForCausalLM"], **TINY
        )
    from benchmarks.model_shapes import hf_config as shape_config

    return shape_config(shape)


def quantization_config(fmt: str) -> dict:
    """config.json's quantization_config as llm-compressor writes FP8_DYNAMIC / W4A16."""
    if fmt == "fp8":
        weights = dict(num_bits=8, type="float", symmetric=True, dynamic=False, strategy="channel")
        activations = dict(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="token")
        fmt_name = "float-quantized"
    else:
        weights = dict(num_bits=4, type="int", symmetric=True, dynamic=False, strategy="group",
                       group_size=INT4_GROUP)  # fmt: skip
        activations, fmt_name = None, "pack-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt_name,
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "format": fmt_name,
            }
        },
    }


# -- checkpoint tensors, quantized as the tools do -------------------------------------------
def quantize_fp8_channel(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors FP8, one scale per output row: weight fp8 [N, K], weight_scale
    [N, 1] in w's dtype (scale = amax(|row|) / 448)."""
    scale = (w.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp(min=1e-12).to(w.dtype)
    q = (w.float() / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}


def quantize_int4_group(w: torch.Tensor, group: int = INT4_GROUP) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized, symmetric: q in [-8, 7] stored as q + 8 in int32
    words (input k at bits 4 * (k % 8) of word k // 8), weight_scale [N, K / group] in w's
    dtype (scale = amax / 7), weight_shape [2]."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // group, group)
    scale = (g.abs().amax(dim=-1) / 7.0).clamp(min=1e-12).to(w.dtype)
    q = (torch.round(g / scale.float()[..., None]).clamp(-8, 7) + 8).to(torch.int64)
    q = q.reshape(rows, cols // 8, 8)
    words = torch.zeros(rows, cols // 8, dtype=torch.int64, device=w.device)
    for i in range(8):
        words |= q[..., i] << (4 * i)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    shape = torch.tensor([rows, cols], dtype=torch.int64)
    return {"weight_packed": words, "weight_scale": scale, "weight_shape": shape}


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """HF linear name (in a layer) -> (out_features, in_features)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def checkpoint_shards(config, fmt: str, device: str, seed: int = 0):
    """(name, CPU tensor) of a random checkpoint in `fmt`, SHARD_END after each layer: what
    the loader's shard reader yields for safetensors files holding these tensors."""
    from atom.models.quantization import SHARD_END

    generator = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return (torch.randn(*shape, device=device, generator=generator) * 0.02).bfloat16()

    quantize = quantize_fp8_channel if fmt == "fp8" else quantize_int4_group
    hidden, vocab = config.hidden_size, config.vocab_size
    yield "model.embed_tokens.weight", randn(vocab, hidden).float().cpu()
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield f"{prefix}.{norm}.weight", torch.ones(hidden)
        for name, shape in linear_shapes(config).items():
            for suffix, tensor in quantize(randn(*shape)).items():
                if tensor.is_floating_point() and tensor.element_size() >= 2:
                    tensor = tensor.float()  # the reader hands scales over in float32
                yield f"{prefix}.{name}.{suffix}", tensor.cpu()
        yield SHARD_END
    yield "model.norm.weight", torch.ones(hidden)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", randn(vocab, hidden).float().cpu()
    yield SHARD_END
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the quantizer's temporaries: the KV cache is sized after


@contextlib.contextmanager
def checkpoint_in_memory(config, fmt: str, device: str):
    """A model directory (config.json with the format's quantization_config, and a
    placeholder safetensors file) whose shards the loader reads from `checkpoint_shards`."""
    from safetensors.torch import save_file

    from atom.models import loader

    with tempfile.TemporaryDirectory() as directory:
        if fmt != "bf16":
            config.quantization_config = quantization_config(fmt)
        config.save_pretrained(directory)
        if fmt != "bf16":
            del config.quantization_config
        save_file({"placeholder": torch.zeros(1)}, str(Path(directory) / "model.safetensors"))
        original = loader._read_shards

        def read_shards(files, wanted, keep_packed=False):
            for item in checkpoint_shards(config, fmt, device):
                if isinstance(item, tuple) and wanted is not None and not wanted(item[0]):
                    continue
                yield item

        loader._read_shards = read_shards
        try:
            yield directory
        finally:
            loader._read_shards = original


# -- engines and measurements -----------------------------------------------------------------
def build_engine(model_dir: str, args, fmt: str, batch: int):
    from atom.model_engine.llm import LLM

    max_model_len = args.input_len + args.output_len + 16
    options = dict(
        load_format="dummy" if fmt == "bf16" else "auto",
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        max_num_seqs=batch,
        max_num_batched_tokens=max(1024, args.input_len * min(batch, 16)),
        device=args.device,
    )
    if batch == 1:
        options.update(
            num_kvcache_blocks=max(64, -(-max_model_len // 16) + 8),
            cuda_graph_batch_sizes=[1],
        )
    if args.device == "cpu":
        options.update(dtype="float32", enforce_eager=True)
    return LLM(model_dir, **options)


def read_bytes(model) -> int:
    """Bytes one decode step reads: every parameter and quantization buffer (scales, zero
    points) but an untied embedding table (one row of it is read)."""
    names = [name for name, _ in model.named_parameters()]
    tied = not any("lm_head" in name for name in names)
    total = 0
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in tensors:
        if "embed_tokens" in name and not tied:
            continue
        if name in names or name.endswith(("weight_scale", "weight_zero_point")):
            total += tensor.numel() * tensor.element_size()
    return total


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids away from the special ones (offline_throughput's, for any vocab)."""
    low = min(1000, vocab // 8)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab - low, (n, length), generator=generator).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def batch1_decode(llm, args) -> dict:
    """Decode tok/s at batch 1: the median of three windows of engine steps."""
    from atom.sampling_params import SamplingParams

    engine = llm.engine
    prompt = random_prompts(1, args.input_len, engine.hf_config.vocab_size, seed=7)[0]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    windows, window = 3, args.window_steps
    total = 8 + windows * window + 4 + 4
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True))
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(4):
        engine.step()
    seconds = []
    for _ in range(windows):
        sync(args.device)
        start = time.perf_counter()
        for _ in range(window):
            engine.step()
        sync(args.device)
        seconds.append((time.perf_counter() - start) / window)
    if args.profile and args.device.startswith("cuda"):
        from benchmarks.decode_profile import kernel_profile, print_top_kernels

        # one table per format, in the order of --formats
        print_top_kernels("batch-1 decode", dict(kernel_profile(engine, 4, 20), model=args.shape))
    while engine.has_unfinished():
        engine.step()
    step_s = statistics.median(seconds)
    return dict(decode_ms_per_step=round(step_s * 1e3, 4), decode_tok_s=round(1 / step_s, 1))


def throughput(llm, args) -> dict:
    from atom.sampling_params import SamplingParams

    vocab = llm.engine.hf_config.vocab_size
    warmup = random_prompts(8, args.input_len, vocab, seed=100)
    llm.generate(warmup, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    sync(args.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    return dict(seconds=round(seconds, 3), output_tok_s=round(generated / seconds, 1))


def run_format(config, fmt: str, args, batch: int, measure) -> dict:
    """Build the engine for `fmt`, measure, free the device; an error is reported and
    returned, not raised (the other formats still run)."""
    record = dict(format=fmt, shape=args.shape)
    llm = None
    try:
        with checkpoint_in_memory(config, fmt, args.device) as model_dir:
            start = time.perf_counter()
            llm = build_engine(model_dir, args, fmt, batch)
            record["load_seconds"] = round(time.perf_counter() - start, 1)
        record["weight_read_bytes"] = read_bytes(llm.engine.model_runner.model)
        record.update(measure(llm, args))
        from atom.kernels.gemv_tiles import quant_gemv_choices

        if fmt != "bf16" and quant_gemv_choices():
            record["gemv_tiles"] = quant_gemv_choices()  # the tuner's, per layer shape
        record["gemv_policy"] = gemv_policy_sites(fmt)
    except Exception as e:  # noqa: BLE001 (a benchmark reports and goes on)
        traceback.print_exc(file=sys.stderr)
        record["error"] = f"{type(e).__name__}: {e}"
    finally:
        if llm is not None:
            llm.engine.shutdown()
        del llm
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return record


def gemv_policy_sites(fmt: str) -> dict[str, str]:
    """The GEMV policy's batch-1 choices for this format's layers (the fused GEMV's tile or
    "unfused", and why), by site label: an FP8 run's sites are those of FP8 weights."""
    from atom.kernels.gemv_policy import current_policy

    fp8 = fmt.startswith("fp8")
    sites = {}
    for record in current_policy().report():
        if ("float8_e4m3fn weight" in record["site"]) == fp8:
            sites[record["site"]] = f"{record['choice']} ({record['reason']})"
    for site, choice in sites.items():
        print(f"  {fmt} GEMV policy: {site} -> {choice}", file=sys.stderr)
    return sites


def stream_read(args) -> float | None:
    if not args.device.startswith("cuda"):
        return None
    from benchmarks.harness import streaming_bandwidth

    return streaming_bandwidth()["stream_read"]


def run_decode(args) -> list[dict]:
    config = hf_config(args.shape)
    bandwidth = stream_read(args)
    records = []
    for fmt in args.formats:
        record = run_format(config, fmt, args, 1, batch1_decode)
        record["case"] = "batch1_decode"
        if bandwidth and "weight_read_bytes" in record:
            record["read_limit_tok_s"] = round(bandwidth / record["weight_read_bytes"], 1)
            if "decode_tok_s" in record:
                record["of_read_limit"] = round(
                    record["decode_tok_s"] / record["read_limit_tok_s"], 3
                )
        records.append(record)
        emit(record)
    add_ratios(records, "decode_tok_s")
    print_table("batch-1 decode", records, "decode_tok_s", ("read_limit_tok_s", "of_read_limit"))
    return records


def run_throughput(args) -> list[dict]:
    config = hf_config(args.shape)
    records = []
    for fmt in args.formats:
        record = run_format(config, fmt, args, args.max_num_seqs, throughput)
        record["case"] = "throughput"
        records.append(record)
        emit(record)
    add_ratios(records, "output_tok_s")
    print_table(f"{args.num_prompts}-prompt throughput", records, "output_tok_s", ())
    return records


def add_ratios(records: list[dict], key: str) -> None:
    base = next((r[key] for r in records if r["format"] == "bf16" and key in r), None)
    for r in records:
        if base and key in r:
            r["over_bf16"] = round(r[key] / base, 3)


def print_table(title: str, records: list[dict], key: str, extra: tuple[str, ...]) -> None:
    print(f"\n{title}, {records[0]['shape'] if records else ''}", file=sys.stderr)
    print(f"{'format':<8}{key:>16}{'x bf16':>10}" + "".join(f"{e:>18}" for e in extra),
          file=sys.stderr)  # fmt: skip
    for r in records:
        if "error" in r:
            print(f"{r['format']:<8}  failed: {r['error'][:100]}", file=sys.stderr)
            continue
        line = f"{r['format']:<8}{r.get(key, float('nan')):>16}{r.get('over_bf16', ''):>10}"
        print(line + "".join(f"{r.get(e, ''):>18}" for e in extra), file=sys.stderr)


# -- --kernels: the GEMVs per layer shape --------------------------------------------------------
def kernel_layers(config) -> dict[str, tuple[int, int]]:
    """The model's linear layers as atom fuses them: (rows, in_features)."""
    shapes = linear_shapes(config)
    q, hidden = shapes["self_attn.q_proj"]
    kv = shapes["self_attn.k_proj"][0]
    inter = shapes["mlp.gate_proj"][0]
    return {"qkv": (q + 2 * kv, hidden), "o": shapes["self_attn.o_proj"],
            "gate_up": (2 * inter, hidden), "down": (hidden, inter)}  # fmt: skip


def quantized_layer(fmt: str, w: torch.Tensor):
    """(layer, method) holding `w` in `fmt` ("fp8", "fp8_block" or "int4"), read and loaded
    by the quantization package from checkpoint tensors."""
    from types import SimpleNamespace

    from torch import nn

    from atom.models.quantization import linear_method, read_quantization_scheme
    from atom.models.quantization.fp8 import read_fp8_weight
    from atom.models.quantization.int4 import read_int4_weight

    if fmt == "fp8_block":
        config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]}  # fmt: skip
        rows, cols = w.shape
        blocks = w.float().reshape(rows // 128, 128, cols // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        tensors = {"weight": (w.float() / full).to(torch.float8_e4m3fn), "weight_scale_inv": scale}
        read = read_fp8_weight
    else:
        config = quantization_config(fmt)
        tensors = (quantize_fp8_channel if fmt == "fp8" else quantize_int4_group)(w)
        read = read_fp8_weight if fmt == "fp8" else read_int4_weight
    scheme = read_quantization_scheme(SimpleNamespace(quantization_config=config))
    method = linear_method(scheme)
    layer = nn.Module()
    method.create_weights(layer, w.shape[0], w.shape[1], [0], 0)
    layer.to(w.device)
    method.load(layer, read("w", tensors, scheme), 0, 0, w.shape[0], 0)
    return layer, method


def kernel_call(fmt: str, layer, x: torch.Tensor):
    from atom.kernels.fp8_linear import fp8_linear
    from atom.kernels.int4_linear import int4_linear

    if fmt.startswith("fp8"):
        return lambda: fp8_linear(x, layer.weight, layer.weight_scale, layer.weight_block)
    return lambda: int4_linear(x, layer.weight, layer.weight_scale, layer.weight_zero_point,
                               layer.weight_group)  # fmt: skip


def time_us(fn, device: str, flush=None) -> float:
    if device.startswith("cuda"):
        from benchmarks.harness import device_us

        return device_us(fn, launches=10, repeats=10, flush=flush)
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3 * 1e6


def layer_bytes(layer) -> int:
    return sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])


def wide_fp8_grid(group: int) -> list:
    """``--sweep-wide``: a grid of FP8 GEMV tiles beyond the tuner's five candidates (x
    broadcast), 16..128 weight bytes per thread and chunk: BLOCK_N 1..16, BLOCK_K
    256..4096, 4 or 8 warps, 1..4 stages."""
    from atom.kernels.gemv_tiles import GemvConfig

    grid = []
    for block_n in (1, 2, 4, 8, 16):
        for block_k in (256, 512, 1024, 2048, 4096):
            for warps in (4, 8):
                per_thread = block_n * block_k // (warps * 32)
                if not 16 <= per_thread <= 128 or (group and block_k % group):
                    continue
                for stages in (1, 2, 3, 4):
                    grid.append((GemvConfig(block_n, block_k, warps, stages), True))
    return grid


def wide_int4_grid() -> list:
    """``--sweep-wide`` for int4: GEMV tiles of 256..2048 outputs by 2..16 word rows, 4 or 8
    warps, 1..3 stages, 2..8 programs per SM, 8..32 words per thread and tile."""
    from atom.kernels.gemv_tiles import GemvConfig

    grid = []
    for block_n in (256, 512, 1024, 2048):
        for block_w in (2, 4, 8, 16):
            for warps in (4, 8):
                if not 8 <= block_n * block_w // (warps * 32) <= 32:
                    continue
                for stages in (1, 2, 3):
                    for waves in (2.0, 4.0, 8.0):
                        grid.append((GemvConfig(block_n, block_w * 8, warps, stages), waves))
    return grid


def sweep_candidates(fmt: str, layer, x: torch.Tensor, device: str, flush,
                     wide: bool = False) -> dict[str, float]:  # fmt: skip
    """Every candidate the one-row tuner measures for this layer, timed alone (us); with
    ``wide`` the grid of ``wide_fp8_grid`` / ``wide_int4_grid`` too, torch._scaled_mm (x
    quantized per row, w8a8) for a per-row scaled FP8 weight, and int4's first candidate
    with the nibble as 2^23 + q instead of a denormal."""
    from atom.kernels import fp8_linear, int4_linear
    from atom.kernels.gemv_tiles import quant_gemv_candidates, quant_gemv_config

    cols = x.shape[1]
    if fmt == "int4":
        group = layer.weight_group
        candidates = int4_linear.int4_gemv_candidates()
        if wide:
            candidates = list(dict.fromkeys(candidates + wide_int4_grid()))

        def launch(c):
            return int4_linear.int4_gemv(x, layer.weight, layer.weight_scale,
                                         layer.weight_zero_point, group, config=c[0],
                                         waves=c[1])  # fmt: skip
    else:
        rows = layer.weight.shape[0]
        per_row = layer.weight_block[1] >= cols
        tile_group = 0 if per_row else layer.weight_block[1]
        heuristic = quant_gemv_config(cols, rows, "fp8", tile_group, True, x.device)
        candidates = quant_gemv_candidates(heuristic, tile_group)
        if wide:
            candidates = list(dict.fromkeys(candidates + wide_fp8_grid(tile_group)))

        def launch(c):
            return fp8_linear.fp8_gemv(x, layer.weight, layer.weight_scale, layer.weight_block,
                                       config=c[0], x_once=c[1])  # fmt: skip

    timed = {}
    for config, variant in candidates:
        label = (f"n{config.block_n} k{config.block_k} w{config.num_warps} "
                 f"s{config.num_stages} {variant}")  # fmt: skip
        try:
            call = functools.partial(launch, (config, variant))
            timed[label] = round(time_us(call, device, flush), 2)
        except Exception as e:  # noqa: BLE001
            timed[label] = f"{type(e).__name__}"
    if wide and fmt == "int4" and x.is_cuda:
        config, waves = int4_linear.int4_gemv_candidates()[0]
        call = functools.partial(int4_linear.int4_gemv, x, layer.weight, layer.weight_scale,
                                 layer.weight_zero_point, layer.weight_group, config=config,
                                 waves=waves, denormal=False)  # fmt: skip
        timed["first, 2^23 + q"] = round(time_us(call, device, flush), 2)
    if wide and fmt == "fp8" and x.is_cuda:
        try:
            call = functools.partial(fp8_linear.fp8_scaled_mm, x, layer.weight, layer.weight_scale)
            timed["scaled_mm"] = round(time_us(call, device, flush), 2)
        except Exception as e:  # noqa: BLE001
            timed["scaled_mm"] = f"{type(e).__name__}"
    return timed


def run_kernels(args) -> list[dict]:
    """Each layer shape at each row count: bf16 cuBLAS against the quantized kernels."""
    config = hf_config(args.shape)
    device = args.device
    flush_buffer = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device != "cpu" \
        else None  # fmt: skip
    flush = (lambda: flush_buffer.zero_()) if flush_buffer is not None else None
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    records = []
    for name, (rows, cols) in kernel_layers(config).items():
        generator = torch.Generator(device).manual_seed(0)
        w = (torch.randn(rows, cols, device=device, generator=generator) * 0.02).bfloat16()
        dense = w.to(dtype)
        for batch in args.rows:
            x = torch.randn(batch, cols, device=device, generator=generator).to(dtype)
            reference = torch.nn.functional.linear(x, dense)
            bf16_us = time_us(
                functools.partial(torch.nn.functional.linear, x, dense), device, flush
            )
            base = dict(case="gemv_kernels", shape=args.shape, layer=name, rows=batch,
                        out_features=rows, in_features=cols)  # fmt: skip
            records.append(dict(base, format="bf16", us=round(bf16_us, 2),
                                gb_s=round(dense.numel() * dense.element_size() / bf16_us / 1e3, 1)))  # fmt: skip
            emit(records[-1])
            for fmt in args.kernel_formats:
                record = dict(base, format=fmt)
                try:
                    layer, method = quantized_layer(fmt, w)
                    call = kernel_call(fmt, layer, x)
                    out = call()
                    # the kernel against its own dequantized weight (not the rounding to fp8
                    # / int4, which quantization_err reports against the bf16 weight)
                    exact = x.float() @ method.dequantize(layer, torch.float32).t()
                    error = (out.float() - exact).abs().max() / exact.abs().max()
                    quant_error = (exact - reference.float()).abs().max() / reference.abs().max()
                    us = time_us(call, device, flush)
                    record.update(us=round(us, 2), gb_s=round(layer_bytes(layer) / us / 1e3, 1),
                                  over_bf16=round(bf16_us / us, 3),
                                  max_rel_err=round(float(error), 5),
                                  quantization_err=round(float(quant_error), 4))  # fmt: skip
                    if args.sweep and batch == 1:
                        record["candidates_us"] = sweep_candidates(
                            fmt, layer, x, device, flush, wide=args.sweep_wide
                        )
                    del layer
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc(file=sys.stderr)
                    record["error"] = f"{type(e).__name__}: {e}"
                records.append(record)
                emit(record)
    from atom.kernels.gemv_tiles import quant_gemv_choices

    for key, choice in quant_gemv_choices().items():
        print(f"tuner: {key}: {choice}", file=sys.stderr)
    for r in records:
        timed = r.get("candidates_us", {})
        ranked = sorted((us, label) for label, us in timed.items() if isinstance(us, float))
        weight_bytes = r.get("gb_s", 0) * r.get("us", 0) * 1e3
        for us, label in ranked[: 10 if args.sweep_wide else len(ranked)]:
            print(f"candidate {r['format']} {r['layer']}: {label}: {us} us "
                  f"{weight_bytes / us / 1e3:.0f} GB/s", file=sys.stderr)  # fmt: skip
        if "scaled_mm" in timed:
            print(f"candidate {r['format']} {r['layer']}: scaled_mm: {timed['scaled_mm']} us",
                  file=sys.stderr)  # fmt: skip
    print(f"\nGEMV per layer, {args.shape} (us; x: bf16 time / this time)", file=sys.stderr)
    for r in records:
        if r["format"] == "bf16":
            print(f"{r['layer']:<8} rows {r['rows']:>3}  bf16 {r['us']:>9.1f} us "
                  f"{r['gb_s']:>7.0f} GB/s", file=sys.stderr, end="")  # fmt: skip
            continue
        text = r.get("error", "")[:40] or f"{r['us']:.1f} us {r['gb_s']:.0f} GB/s x{r['over_bf16']}"
        print(f" | {r['format']} {text}", file=sys.stderr, end="")
        if r["format"] == args.kernel_formats[-1]:
            print(file=sys.stderr)
    return records


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shape", default="llama-3.1-8b", help="a benchmarks/model_shapes name, or tiny"
    )
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=None)
    parser.add_argument("--kernels", action="store_true", help="per-layer GEMV microbenchmark")
    parser.add_argument("--kernel-formats", nargs="+", default=["fp8", "fp8_block", "int4"],
                        choices=["fp8", "fp8_block", "int4"])  # fmt: skip
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--profile", action="store_true",
                        help="batch-1 decode: print the costliest kernels of a step")  # fmt: skip
    parser.add_argument("--sweep", action="store_true",
                        help="with --kernels: time every one-row tuner candidate")  # fmt: skip
    parser.add_argument("--sweep-wide", action="store_true",
                        help="with --sweep: FP8 also over a grid of tiles and torch._scaled_mm")  # fmt: skip
    parser.add_argument("--throughput", action="store_true", help="256-prompt throughput")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--window-steps", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.input_len is None:
        args.input_len = 512 if args.throughput else 128
    if args.formats is None:
        args.formats = ["bf16", "fp8"] if args.throughput else list(FORMATS)
    if args.shape == "llama-3.1-70b" and args.formats == list(FORMATS) and not args.kernels:
        args.formats = ["fp8"]  # bf16 (~141 GB) and int4 aside: the 70B bar is FP8 on one H200
    return args


def run(args) -> list[dict]:
    if args.kernels:
        return run_kernels(args)
    if args.throughput:
        return run_throughput(args)
    return run_decode(args)


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

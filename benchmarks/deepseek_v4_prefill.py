"""DeepSeek-V4 time to first token: atom's prefill, Triton sparse against torch dense, and HF.

    python -m benchmarks.deepseek_v4_prefill [--layers 4] [--prompts 8192 65536]
        [--chunk 8192] [--repeats 3] [--prefill-attention triton torch] [--skip-hf]
    python -m benchmarks.deepseek_v4_prefill --sweep-kernel [--prompts 8192 65536]

The V4 shape of `benchmarks.deepseek_v4_decode` (hidden 4096, 64 heads of 512, window 128,
CSA 4 / HCA 128, index_topk 512, 16 experts; random bf16 weights saved once with HF's
`save_pretrained`). Per prompt length, the time to first token of one sequence: the whole
prompt prefilled in engine steps of at most `--chunk` tokens (the engine's chunked prefill,
`max_num_batched_tokens`), then its first token sampled; the median of `--repeats` runs
after a warm-up prompt that compiles every kernel (a first chunk and a later one).

`--prefill-attention triton torch` (the A/B switch, atom/attention/v4.py
`PREFILL_ATTENTION`): one engine per value in this process, each timing every prompt: the
CUDA path's sparse Triton prefill (atom/kernels/v4_prefill_attention.py, the indexer's
select over the query tokens) or the torch path's dense masks in 512-query chunks. One JSON
line per engine and prompt (`ttft`), then `prefill_attention_summary`: each value's time
over the first value's, per prompt length. HF (unless `--skip-hf`): its forward over the
whole prompt with `logits_to_keep=1`, timed the same way (`error` when it does not fit).

`--sweep-kernel` (no engine): the attention kernel alone at the benchmark's shape, the last
`--chunk` queries of each prompt length (random bf16 inputs; CSA: 512 random picks a query,
HCA: every visible entry), one `kernel` line per geometry of `GEOMETRIES` (BLOCK_H,
BLOCK_N, warps, stages; `error` where one does not compile) and the torch reference over
the same queries in 512-query chunks (`reference_ms`), for choosing the module's defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import statistics
import tempfile
import time

import torch

from benchmarks.deepseek_v4_decode import CSA, HCA, save_random_model, v4_shape
from benchmarks.harness import emit

PREFILL_ATTENTION_CHOICES = ("triton", "torch")


@contextlib.contextmanager
def prefill_attention(value: str):
    """atom/attention/v4.py's PREFILL_ATTENTION (V4 and V4.1) set to ``value`` inside."""
    from atom.attention import v4

    if value not in PREFILL_ATTENTION_CHOICES:
        raise ValueError(f"--prefill-attention {value!r}: one of {PREFILL_ATTENTION_CHOICES}")
    default = v4.PREFILL_ATTENTION
    v4.PREFILL_ATTENTION = value
    try:
        yield
    finally:
        v4.PREFILL_ATTENTION = default


def max_model_len(prompts: list[int]) -> int:
    """The engine's max_model_len: the longest prompt, its first token and a margin."""
    return max(prompts) + 64


def ratios_over_first(times: dict, settings: list[str], prompts: list[int]) -> dict:
    """{prompt: {setting: time / the first setting's time}} from {(setting, prompt): ms}."""
    first = settings[0]
    return {
        str(p): {s: round(times[(s, p)] / times[(first, p)], 3) for s in settings} for p in prompts
    }


def build_engine(path: str, args):
    from atom.model_engine.llm import LLM

    return LLM(
        path,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=max_model_len(args.prompts),
        max_num_seqs=1,
        max_num_batched_tokens=args.chunk,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cuda_graph_batch_sizes=[1],
    )


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (length,), generator=generator).tolist()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def atom_ttft_ms(llm, prompt: list[int]) -> float:
    """Milliseconds from submitting ``prompt`` to its first token (every prefill chunk)."""
    from atom.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    synchronize()
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    synchronize()
    return (time.perf_counter() - start) * 1e3


def hf_ttft_ms(model, prompt: list[int]) -> float:
    from transformers import DynamicCache

    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        torch.cuda.synchronize()
        start = time.perf_counter()
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def median_ms(measure, argument, repeats: int) -> float:
    return statistics.median(measure(argument) for _ in range(repeats))


def run_hf(model, args, vocab: int) -> None:
    for length in args.prompts:
        prompt = random_prompt(length, vocab, length)
        try:
            hf_ttft_ms(model, prompt[: min(length, args.chunk)])  # warm-up
            ms = median_ms(functools.partial(hf_ttft_ms, model), prompt, args.repeats)
            emit(case="ttft", engine="hf", prompt_len=length, ms=round(ms, 2),
                 prompt_tok_s=round(length / ms * 1e3, 1))  # fmt: skip
        except (torch.OutOfMemoryError, RuntimeError) as error:  # too large for HF's attention
            emit(case="ttft", engine="hf", prompt_len=length, error=str(error).splitlines()[0])
        gc.collect()
        torch.cuda.empty_cache()


def run_atom(path: str, args, vocab: int) -> dict:
    """One engine per --prefill-attention value; {(value, prompt): ms}."""
    times = {}
    for value in args.prefill_attention:
        with prefill_attention(value):
            llm = build_engine(path, args)
            times.update(time_prompts(llm, value, args, vocab))
            llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return times


def time_prompts(llm, value: str, args, vocab: int) -> dict:
    """{(value, prompt): median ms} of every --prompts length on ``llm``, one `ttft` line
    each, after a warm-up prompt."""
    warm = random_prompt(min(max(args.prompts), 2 * args.chunk + 100), vocab, 1)
    atom_ttft_ms(llm, warm)  # compiles: a first chunk and a later one
    times = {}
    for length in args.prompts:
        prompt = random_prompt(length, vocab, length)
        ms = times[(value, length)] = median_ms(
            functools.partial(atom_ttft_ms, llm), prompt, args.repeats
        )
        emit(case="ttft", engine="atom", prefill_attention=value, prompt_len=length,
             chunk=args.chunk, ms=round(ms, 2), prompt_tok_s=round(length / ms * 1e3, 1))  # fmt: skip
    return times


# (block_h, block_n, num_warps, num_stages) of `v4_prefill_attention` that --sweep-kernel times
GEOMETRIES = [
    (16, 32, 4, 2),
    (32, 32, 8, 2),
    (32, 16, 4, 2),
    (32, 64, 8, 2),
    (64, 32, 8, 2),
    (32, 32, 8, 3),
    (16, 64, 4, 2),
]


def kernel_inputs(prompt: int, chunk: int, kind: str, shape: dict, generator,
                  device: str = "cuda", dtype=torch.bfloat16) -> tuple:  # fmt: skip
    """Arguments of `v4_prefill_attention` for the last ``chunk`` queries of a
    ``prompt``-token sequence at ``shape`` (``kind``: "csa" or "hca")."""
    heads, dim, window = shape["num_attention_heads"], shape["head_dim"], shape["sliding_window"]
    ratio = shape["compress_rates"][CSA if kind == "csa" else HCA]
    start = max(0, prompt - chunk)
    key_first = max(0, start - window + 1)
    like = dict(device=device, dtype=dtype)
    q = torch.randn(prompt - start, heads, dim, generator=generator, **like)
    keys = torch.randn(prompt - key_first, dim, generator=generator, **like)
    entries = torch.randn(prompt // ratio, dim, generator=generator, **like)
    sinks = torch.randn(heads, device=device, generator=generator)
    ids = None
    if kind == "csa":  # index_topk picks a query among its visible entries, -1 after them
        positions = torch.arange(start, prompt, device=device)
        visible = ((positions + 1) // ratio)[:, None]
        scores = torch.rand(prompt - start, entries.shape[0], device=device, generator=generator)
        scores = scores.masked_fill(torch.arange(entries.shape[0], device=device) >= visible, -1)
        top = scores.topk(min(shape["index_topk"], entries.shape[0]), dim=1)
        ids = torch.where(top.values >= 0, top.indices, -1)
    return q, keys, key_first, start, entries, ids, ratio, window, sinks, dim**-0.5


def sweep_kernel(args) -> None:
    shape = v4_shape(args.layers, max_model_len(args.prompts))
    generator = torch.Generator("cuda").manual_seed(0)
    for prompt in args.prompts:
        for kind in ("csa", "hca"):
            inputs = kernel_inputs(prompt, args.chunk, kind, shape, generator)
            time_geometries(dict(case="kernel", kind=kind, prompt_len=prompt), inputs, args)
            torch.cuda.empty_cache()


def reference_in_chunks(q, keys, key_first, start, entries, ids, *rest) -> None:
    """The torch reference as the engine's CPU path runs it: 512 queries at a time."""
    from atom.attention.v4 import QUERY_CHUNK
    from atom.kernels.v4_prefill_attention import v4_prefill_attention_reference

    for c in range(0, q.shape[0], QUERY_CHUNK):
        chosen = None if ids is None else ids[c : c + QUERY_CHUNK]
        v4_prefill_attention_reference(q[c : c + QUERY_CHUNK], keys, key_first, start + c,
                                       entries, chosen, *rest)  # fmt: skip


def time_geometries(record: dict, inputs: tuple, args) -> None:
    """One `kernel` line per geometry of GEOMETRIES (with the reference's time)."""
    from atom.kernels.v4_prefill_attention import v4_prefill_attention
    from benchmarks.harness import event_ms

    reference = functools.partial(reference_in_chunks, *inputs)
    record = dict(record, queries=inputs[0].shape[0],
                  reference_ms=round(event_ms(reference, args.repeats), 3))  # fmt: skip
    for block_h, block_n, warps, stages in GEOMETRIES:
        geometry = dict(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            run = functools.partial(v4_prefill_attention, *inputs, **geometry)
            emit(record, **geometry, ms=round(event_ms(run, args.repeats), 3))
        except Exception as error:  # a geometry that does not compile (or fit) here
            emit(record, **geometry, error=str(error).splitlines()[0][:200])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument(
        "--chunk", type=int, default=8192,
        help="tokens per engine step (max_num_batched_tokens): the prefill's chunk",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--prefill-attention", nargs="+", default=["triton", "torch"],
        choices=PREFILL_ATTENTION_CHOICES,
        help="one engine per value: the CUDA path's sparse Triton prefill (triton) or the "
        "dense torch one (torch); the summary gives each over the first",
    )  # fmt: skip
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--sweep-kernel", action="store_true",
        help="no engine: the attention kernel alone per geometry (GEOMETRIES) and the torch "
        "reference, the last --chunk queries of each prompt length",
    )  # fmt: skip
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    args = parser.parse_args(argv)
    if min(args.prompts) < 1 or args.chunk < 1 or args.repeats < 1:
        parser.error("--prompts, --chunk and --repeats must be positive")
    if len(set(args.prefill_attention)) != len(args.prefill_attention):
        parser.error("--prefill-attention: each value once")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sweep_kernel:
        sweep_kernel(args)
        return 0
    shape = v4_shape(args.layers, max_model_len(args.prompts))
    vocab = shape["vocab_size"]
    with tempfile.TemporaryDirectory() as path:
        hf_model = save_random_model(path, shape)
        if not args.skip_hf:  # before atom sizes its cache from the free memory
            run_hf(hf_model, args, vocab)
        del hf_model
        gc.collect()
        torch.cuda.empty_cache()
        times = run_atom(path, args, vocab)
    emit(case="prefill_attention_summary", chunk=args.chunk,
         ms_over_first=ratios_over_first(times, args.prefill_attention, args.prompts))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

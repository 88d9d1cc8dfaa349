"""GDN prefill benchmark (GPU): the chunked delta-rule kernels against the sequential kernel
and the torch reference, in a Qwen3-Next layer's shape (16 k heads, 32 v heads, 128 dims).

    python -m benchmarks.gdn_prefill            # about a minute on an H200
    python -m benchmarks.gdn_prefill --no-sweep # without the tile / precision sweep

One JSON line per measurement, on stdout (also run by benchmarks/kernels.py):

- ``gdn_prefill``: per (sequences x tokens) case, bf16 inputs, device milliseconds of
  ``chunk_gated_delta_rule`` (sequential: one program per sequence, head and 32 values,
  walking the tokens), ``chunked_gated_delta_rule`` (atom/kernels/gdn_chunk.py, defaults)
  and, where ``reference`` is set, ``chunk_gated_delta_rule_reference`` (torch, a loop over
  each sequence's chunks); ``speedup`` = sequential / chunked; the max abs output error of
  each kernel against the reference on the same bf16-rounded inputs (fp32). The crossover
  length and sequence count set `use_chunked` (the GDN backend's choice). ``conv_prefill_ms``: the
  layer's other prefill kernel (`causal_conv1d_prefill`, conv_dim 8192), for scale.
- ``gdn_prefill_tile``: the chunked kernels at 4 x 8192 tokens for other state-pass tiles
  (block_v, num_warps) and dot precisions (ieee, tf32x3, tf32), with their errors.

Timing: CUDA events around one call (prefill is not graphed), median of 7 after a warm-up.
"""

from __future__ import annotations

import argparse
import sys

import torch

from atom.fusions import Fusions
from atom.kernels.gdn_chunk import chunked_gated_delta_rule, use_chunked
from atom.kernels.gdn_conv import causal_conv1d_prefill
from atom.kernels.gdn_delta_rule import chunk_gated_delta_rule, chunk_gated_delta_rule_reference
from benchmarks.harness import emit, event_ms

NUM_K_HEADS, NUM_V_HEADS, HEAD_DIM, CONV_WIDTH = 16, 32, 128, 4
CONV_DIM = (2 * NUM_K_HEADS + NUM_V_HEADS) * HEAD_DIM
# (sequences, tokens each, time the torch reference too)
CASES = [
    (4, 8192, True),
    (1, 8192, False),
    (1, 2048, False),
    (8, 1024, False),
    (1, 512, False),
    (16, 256, False),
    (1, 256, False),
    (32, 128, False),
    (64, 64, False),
    (128, 16, False),
]


def prefill_case(num_seqs: int, length: int, seed: int = 0):
    """bf16 q/k/v of `num_seqs` sequences of `length` tokens (half of them continuing from
    a random state), fp32 g / beta, one state slot each plus the scratch row."""
    gen = torch.Generator("cuda").manual_seed(seed)
    total = num_seqs * length
    kw = dict(device="cuda", generator=gen)
    q = torch.randn(total, NUM_K_HEADS, HEAD_DIM, **kw).bfloat16()
    k = torch.randn(total, NUM_K_HEADS, HEAD_DIM, **kw).bfloat16()
    v = torch.randn(total, NUM_V_HEADS, HEAD_DIM, **kw).bfloat16()
    g = -torch.rand(total, NUM_V_HEADS, **kw) * 0.5
    beta = torch.rand(total, NUM_V_HEADS, **kw)
    state = torch.randn(num_seqs + 1, NUM_V_HEADS, HEAD_DIM, HEAD_DIM, **kw) * 0.3
    cu = (torch.arange(num_seqs + 1, device="cuda") * length).int()
    slots = torch.arange(num_seqs, device="cuda", dtype=torch.int32)
    fresh = (slots % 2).int()
    return q, k, v, g, beta, state, cu, slots, fresh


def _error(out, expected) -> float:
    return round((out.float() - expected).abs().max().item(), 5)


def bench_case(num_seqs: int, length: int, with_reference: bool) -> None:
    q, k, v, g, beta, state, cu, slots, fresh = prefill_case(num_seqs, length)
    ref_state = state.clone()
    rounded = [x.float() for x in (q, k, v)]
    expected = chunk_gated_delta_rule_reference(*rounded, g, beta, ref_state, cu, slots, fresh)
    errors = {}
    for name, rule in (
        ("sequential", chunk_gated_delta_rule),
        ("chunked", chunked_gated_delta_rule),
    ):
        work = state.clone()
        errors[name] = _error(rule(q, k, v, g, beta, work, cu, slots, fresh), expected)
    work = state.clone()
    sequential = event_ms(lambda: chunk_gated_delta_rule(q, k, v, g, beta, work, cu, slots, fresh))
    chunked = event_ms(lambda: chunked_gated_delta_rule(q, k, v, g, beta, work, cu, slots, fresh))
    x = torch.randn(num_seqs * length, CONV_DIM, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(CONV_DIM, CONV_WIDTH, device="cuda", dtype=torch.bfloat16)
    conv_state = torch.zeros(num_seqs + 1, CONV_WIDTH - 1, CONV_DIM, device="cuda", dtype=x.dtype)
    conv = event_ms(lambda: causal_conv1d_prefill(x, conv_state, weight, cu, slots, fresh))
    record = dict(
        bench="gdn_prefill",
        seqs=num_seqs,
        tokens_per_seq=length,
        sequential_ms=round(sequential, 3),
        chunked_ms=round(chunked, 3),
        conv_prefill_ms=round(conv, 3),
        speedup=round(sequential / chunked, 2),
        chunked_default=use_chunked(length, num_seqs, Fusions.from_env().gdn_chunked_min_tokens),
        sequential_error=errors["sequential"],
        chunked_error=errors["chunked"],
    )
    if with_reference:
        record["reference_ms"] = round(
            event_ms(
                lambda: chunk_gated_delta_rule_reference(q, k, v, g, beta, work, cu, slots, fresh),
                repeats=3,
            ),
            3,
        )
    emit(**record)


def bench_tiles(num_seqs: int = 4, length: int = 8192) -> None:
    q, k, v, g, beta, state, cu, slots, fresh = prefill_case(num_seqs, length)
    ref_state = state.clone()
    rounded = [x.float() for x in (q, k, v)]
    expected = chunk_gated_delta_rule_reference(*rounded, g, beta, ref_state, cu, slots, fresh)
    for precision in ("ieee", "tf32x3", "tf32"):
        for block_v in (16, 32, 64):
            for num_warps in (4, 8):
                tile = dict(precision=precision, block_v=block_v, num_warps=num_warps)
                work = state.clone()
                out = chunked_gated_delta_rule(q, k, v, g, beta, work, cu, slots, fresh, **tile)
                error, state_error = _error(out, expected), _error(work, ref_state)
                ms = event_ms(
                    lambda tile=tile, work=work: chunked_gated_delta_rule(
                        q, k, v, g, beta, work, cu, slots, fresh, **tile
                    )
                )
                emit(
                    bench="gdn_prefill_tile",
                    seqs=num_seqs,
                    tokens_per_seq=length,
                    **tile,
                    ms=round(ms, 3),
                    error=error,
                    state_error=state_error,
                )


def bench_gdn_prefill(sweep: bool = True) -> None:
    for num_seqs, length, with_reference in CASES:
        bench_case(num_seqs, length, with_reference)
        torch.cuda.empty_cache()
    if sweep:
        bench_tiles()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    emit(bench="env", device=torch.cuda.get_device_name(), torch=torch.__version__)
    bench_gdn_prefill(sweep=not args.no_sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())

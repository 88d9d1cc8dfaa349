"""`python3 -m benchmarks.sampler_variants` (H200): which part of the options pass costs.

The options + argmax pass of the sampler as it was before issue 16's third pass (every block
looping over all of its row's bias entries), with each part switchable: the bias loop
(BIAS), the penalty counts (COUNTS), the argmax (ARG), at BLOCK 2048-16384 and 4-16 warps,
on [256, 128256] bf16 logits with 16 bias entries per row; device ms per call by CUDA-graph
replay. It showed the bias loop tripling the pass (docs/benchmarks.md, "Sampler options"),
which led to the per-block bias offsets of atom/kernels/sampling.py.
"""

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["vocab_size", "bias_width", "stop_width", "logits_stride"])
def _v(
    logits_ptr,
    logits_stride,
    state_rows_ptr,
    counts_ptr,
    row_floats_ptr,
    row_ints_ptr,
    bias_tokens_ptr,
    bias_values_ptr,
    bias_width,
    stop_ids_ptr,
    stop_width,
    vocab_size,
    block_max_ptr,
    block_arg_ptr,
    BLOCK: tl.constexpr,
    BIAS: tl.constexpr,
    COUNTS: tl.constexpr,
    ARG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    start = block.to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < vocab_size - block * BLOCK
    x = tl.load(logits_ptr + row * logits_stride + start + offs, mask=mask, other=0.0).to(
        tl.float32
    )
    state = tl.load(state_rows_ptr + row).to(tl.int64)
    presence = tl.load(row_floats_ptr + state * 3)
    frequency = tl.load(row_floats_ptr + state * 3 + 1)
    repetition = tl.load(row_floats_ptr + state * 3 + 2)
    num_bias = tl.load(row_ints_ptr + state * 4 + 2)
    if BIAS:
        for j in range(num_bias):
            token = tl.load(bias_tokens_ptr + state * bias_width + j)
            value = tl.load(bias_values_ptr + state * bias_width + j)
            x = tl.where(offs == token - start, x + value, x)
    if COUNTS:
        counts = tl.load(counts_ptr + state * vocab_size + start + offs, mask=mask, other=0)
        output = (counts & 0x3FFFFFFF).to(tl.float32)
        seen = (counts >= 0x40000000) | (output > 0)
        penalised = tl.where(x > 0, x / repetition, x * repetition)
        x = tl.where(seen, penalised, x)
        x = x - frequency * output
        x = x - tl.where(output > 0, presence, 0.0)
    x = tl.where(mask, x, float("-inf"))
    best = tl.max(x, 0)
    slot = row * tl.num_programs(1) + block
    tl.store(block_max_ptr + slot, best)
    if ARG:
        index = tl.min(tl.where((x == best) & mask, offs, BLOCK), 0)
        tl.store(block_arg_ptr + slot, start + tl.minimum(index, BLOCK - 1))


def graph_ms(fn, n=20):
    """Device ms per call of `fn`, n calls captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / (5 * n)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    rows, vocab, width = 256, 128256, 16
    device = "cuda"
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab, device=device).bfloat16()
    counts = torch.randint(0, 2, (rows, vocab), device=device, dtype=torch.int32)
    state_rows = torch.randperm(rows, device=device).int()
    floats = torch.tensor([0.5, 0.3, 1.1], device=device).repeat(rows, 1)
    ints = torch.tensor([0, 5, width, 0], device=device, dtype=torch.int32).repeat(rows, 1)
    tokens = torch.randint(0, vocab, (rows, width), device=device, dtype=torch.int32)
    values = torch.randn(rows, width, device=device)
    stop = torch.zeros(rows, 1, device=device, dtype=torch.int32)
    read_ms = graph_ms(lambda: logits.float().sum())
    print(json.dumps(dict(case="read_only_sum", ms=round(read_ms, 4))))
    for block, warps in ((4096, 4), (4096, 8), (2048, 4), (8192, 8), (16384, 16), (8192, 16)):
        blocks = triton.cdiv(vocab, block)
        best = torch.empty(rows, blocks, device=device)
        arg = torch.empty(rows, blocks, device=device, dtype=torch.int64)
        for bias, cnt, argmax in ((1, 1, 1), (0, 1, 1), (1, 0, 1), (0, 0, 1), (0, 0, 0), (1, 1, 0)):

            def launch(block=block, warps=warps, bias=bias, cnt=cnt, argmax=argmax, blocks=blocks, best=best, arg=arg):  # fmt: skip
                _v[(rows, blocks)](
                    logits, logits.stride(0), state_rows, counts, floats, ints, tokens, values,
                    width, stop, 1, vocab, best, arg,
                    BLOCK=block, BIAS=bias, COUNTS=cnt, ARG=argmax, num_warps=warps,
                )  # fmt: skip

            record = dict(case="variant", BLOCK=block, warps=warps, bias=bias, counts=cnt, arg=argmax)  # fmt: skip
            print(json.dumps(dict(record, ms=round(graph_ms(launch), 4))))


if __name__ == "__main__":
    main()

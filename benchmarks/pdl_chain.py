"""`python3 -m benchmarks.pdl_chain` (H200): does programmatic dependent launch (PDL)
shorten a chain of batch-1 GEMVs replayed from one CUDA graph?

Each layer runs the one-row GEMVs of the Llama-3.2-1B (16 layers) or SmolLM2-135M (30
layers) shape with gemv_config's tiles (the GEMV policy's, else the heuristic's), each
reading the previous one's output. The variants: PDL (`gdc_launch_dependents` first, `gdc_wait` before the first
dependent access), PDL with the first weight tile loaded before the wait (the weight never
depends on the previous kernel), the prefetch alone, and PDL with a non-PDL torch kernel
in each layer. One JSON line each: device us per chain, the ratio against the plain chain
and whether the outputs equal it. An experiment for issue 17 (docs/benchmarks.md): the
engine's kernels do not use PDL.
"""

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv(
    x_ptr,
    w_ptr,
    out_ptr,
    K,
    N,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    offs_k = tl.arange(0, BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.bfloat16)
    if PREFETCH:  # the weight never depends on the previous kernel
        w0 = tl.load(
            rows + offs_k[None, :],
            mask=n_mask[:, None] & (offs_k < K)[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
    if PDL:
        tl.extra.cuda.gdc_wait()
    if not PREFETCH:
        w0 = tl.load(
            rows + offs_k[None, :],
            mask=n_mask[:, None] & (offs_k < K)[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
    x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    acc = w0.to(tl.float32) * x[None, :]
    for k_start in range(BLOCK_K, K, BLOCK_K):
        ok = k_start + offs_k
        w = tl.load(
            rows + ok[None, :],
            mask=n_mask[:, None] & (ok < K)[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        x = tl.load(x_ptr + ok, mask=ok < K, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(out_ptr + offs_n, tl.sum(acc, 1).to(tl.bfloat16), mask=n_mask)


def chain(shapes, layers, cfg):
    ws = [
        [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for (k, n, *_) in shapes]
        for _ in range(layers)
    ]
    width = max(max(k, n) for (k, n, *_) in shapes)
    bufs = [
        torch.randn(width, device="cuda", dtype=torch.bfloat16)
        for _ in range(len(shapes) * layers + 1)
    ]

    def run(pdl, prefetch, breaker=False):
        i = 0
        for layer in range(layers):
            for s, (k, n, bn, bk, warps) in enumerate(shapes):
                _gemv[(triton.cdiv(n, bn),)](
                    bufs[i],
                    ws[layer][s],
                    bufs[i + 1],
                    k,
                    n,
                    BLOCK_N=bn,
                    BLOCK_K=bk,
                    PDL=pdl,
                    PREFETCH=prefetch,
                    num_warps=warps,
                    launch_pdl=pdl,
                )
                if breaker and s == 1:
                    bufs[i + 1].mul_(1.0)  # a non-PDL torch kernel in the chain
                i += 1
        return bufs[i]

    return run


def timed_graph(fn):
    """Median device us of one replay of `fn` captured in a CUDA graph, and its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        ts.append(begin.elapsed_time(end))
    return sorted(ts)[3] * 1e3, out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    for name, (shapes, layers) in SHAPES.items():
        run = chain(shapes, layers, None)
        ref_us, ref = timed_graph(lambda: run(False, False))  # noqa: B023
        ref = ref.clone()
        variants = ((True, False, False), (True, True, False), (False, True, False), (True, True, True), (False, False, True))  # fmt: skip
        for pdl, prefetch, breaker in variants:
            us, out = timed_graph(lambda: run(pdl, prefetch, breaker))  # noqa: B023
            same = torch.equal(out, ref) if not breaker else None
            print(json.dumps(dict(model=name, kernels=len(shapes) * layers, pdl=pdl, prefetch=prefetch, breaker=breaker, us=round(us, 1), baseline_us=round(ref_us, 1), ratio=round(ref_us / us, 3), same_output=same)), flush=True)  # fmt: skip


SHAPES = {
    "llama-1b": (
        [
            (2048, 3072, 1, 1024, 2),
            (2048, 2048, 1, 1024, 2),
            (2048, 16384, 1, 1024, 1),
            (8192, 2048, 1, 1024, 4),
        ],
        16,
    ),
    "smollm2": (
        [
            (576, 960, 2, 1024, 8),
            (576, 576, 2, 1024, 8),
            (576, 3072, 1, 1024, 1),
            (1536, 576, 1, 2048, 4),
        ],
        30,
    ),
}


if __name__ == "__main__":
    main()

"""DeepSeek-V2-Lite-shape MoE decode (GPU): the old dense and per-expert dispatch against
the fused one (atom/models/moe.py -> atom/kernels/moe.py), in one run.

    python -m benchmarks.moe_decode               # H200: about 2 minutes, ~31 GB
    python -m benchmarks.moe_decode --batch 1 64 --layers 26 --no-tiles

Shape (DeepSeek-V2-Lite): hidden 2048, 64 routed experts, 6 per token (softmax, greedy
top-k), 2 shared experts, moe_intermediate 1408; the 26 MoE layers of its 27 (layer 0 is a
dense MLP), random bf16 weights (28.8 GB routed, 0.9 GB shared). Only the MoE blocks run
(an unweighted RMSNorm, router, routed and shared experts, residual add), one after the other as in a decode step;
no attention, no norms.

One JSON line per (batch, path) on stdout:
- ``dense_graph``: the old CUDA-graph path: every routed expert on every token, unchosen
  ones weighted by zero, replayed as a CUDA graph (what decode ran before).
- ``per_expert_eager``: the old eager path: one ``torch.where`` + ``index_add_`` per hit
  expert and layer (a host sync each). Its output is the reference (HF's numerics).
- ``fused_eager`` / ``fused_graph``: ``DeepseekMoE.forward`` now (Triton align + gate_up +
  down + sum over k; at most ``moe.DECODE_GEMV_MAX_PAIRS`` pairs, one GEMV per pair
  instead), eager and replayed as a CUDA graph.
On CPU (``--device cpu``, for a smoke run) ``dense_eager`` replaces ``dense_graph`` and
there are no graph paths.
Fields: ``ms`` per decode step (median), ``speedup_vs_dense`` (dense_graph's ms / ms),
``routed_gb`` (routed expert weights a step must read: the experts hit, per layer), ``gbps``
(routed + shared weight bytes / time), ``max_rel_err`` (max |out - reference| /
max |reference|).
``align_us``: device time of the sort by expert alone (moe_align, one Triton program).
Then, unless ``--no-tiles``, ``fused_graph_tiles``: the fused graph through the grouped
GEMMs (given tiles: never the per-pair GEMV) with other tile shapes (``default`` marks the
one default_tiles picks). ``--prefill 2048`` (default) also runs
``per_expert_eager`` and ``fused_eager`` on 2048 tokens at once (no dense, no graphs). A
last ``summary`` line.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

import torch
from torch.nn import functional as F

from atom.kernels.moe import MoeTiles, default_tiles, fused_moe, moe_align
from atom.models.deepseek_v2 import DeepseekMoE
from benchmarks.harness import emit

TILES = [
    MoeTiles(16, 64, 128),
    MoeTiles(16, 32, 128),
    MoeTiles(16, 128, 64),
    MoeTiles(16, 64, 64, num_stages=4),
    MoeTiles(16, 64, 256, num_stages=2),
    MoeTiles(32, 64, 64),
]


def make_layers(args, device, dtype) -> list[DeepseekMoE]:
    config = SimpleNamespace(
        model_type="deepseek_v2",
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        n_shared_experts=args.shared,
        routed_scaling_factor=1.0,
        topk_method="greedy",
        norm_topk_prob=False,
    )
    generator = torch.Generator(device).manual_seed(0)
    layers = []
    with torch.device(device), torch.no_grad():
        for _ in range(args.layers):
            moe = DeepseekMoE(config)
            for param in moe.parameters():  # std 1/sqrt(fan_in): outputs of order 1
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
            layers.append(moe.to(dtype).eval())
    return layers


# -- the old dispatch paths (deleted from DeepseekMoE; kept here to compare against) ----------


def _expert(moe: DeepseekMoE, e: int, x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, moe.experts.gate_up_proj[e]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, moe.experts.down_proj[e])


def dense_forward(moe: DeepseekMoE, x: torch.Tensor) -> torch.Tensor:
    """The old capture path: every expert on every token, weighted by zero unless chosen."""
    weights, ids = moe.gate(x)
    out = torch.zeros_like(x)
    dense = torch.zeros(x.shape[0], moe.num_experts, dtype=weights.dtype, device=x.device)
    dense.scatter_(1, ids, weights)
    for e in range(moe.num_experts):
        out += (_expert(moe, e, x) * dense[:, e, None]).to(x.dtype)
    return out + moe.shared_experts(x)


def per_expert_forward(moe: DeepseekMoE, x: torch.Tensor, hits: list | None = None):
    """The old eager path: the tokens of each expert in turn (a host sync per expert)."""
    weights, ids = moe.gate(x)
    out = torch.zeros_like(x)
    hit = 0
    for e in range(moe.num_experts):
        tokens, slots = torch.where(ids == e)
        if tokens.numel() == 0:
            continue
        hit += 1
        y = _expert(moe, e, x[tokens]) * weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    if hits is not None:
        hits.append(hit)
    return out + moe.shared_experts(x)


def fused_forward(tiles: MoeTiles):
    def forward(moe: DeepseekMoE, x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe.gate(x)
        experts = moe.experts
        out = fused_moe(x, weights, ids, experts.gate_up_proj, experts.down_proj, tiles=tiles)
        return out + moe.shared_experts(x)

    return forward


def decode_step(layers, forward, x) -> Callable[[], torch.Tensor]:
    def step():
        hidden = x
        for moe in layers:
            # Pre-norm as in the decoder: without it the residual grows quadratically per
            # layer with random weights and overflows bf16 (inf - inf = NaN) by layer ~20.
            normed = hidden * torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(
                hidden.dtype
            )
            hidden = hidden + forward(moe, normed)
        return hidden

    return step


# -- timing -----------------------------------------------------------------------------------


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eager_ms(step, device, min_seconds: float, max_iters: int = 50) -> float:
    """Median wall time of one step (host syncs included), after a warm-up step."""
    step()
    _sync(device)
    samples = []
    began = time.perf_counter()
    while len(samples) < 3 or (
        len(samples) < max_iters and time.perf_counter() - began < min_seconds
    ):
        start = time.perf_counter()
        step()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def graph_ms(step, repeats: int) -> tuple[float, torch.Tensor]:
    """Median device time of one replay of ``step`` captured as a CUDA graph, and its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples), out


def align_us(moe: DeepseekMoE, x: torch.Tensor, top_k: int) -> float:
    """Device microseconds of one moe_align (the sort by expert) for x's tokens."""
    _, ids = moe.gate(x)
    block_m = default_tiles(ids.numel(), moe.num_experts).block_m

    def launches():
        for _ in range(20):
            moe_align(ids, moe.num_experts, block_m)

    ms, _ = graph_ms(launches, repeats=10)
    return ms * 1e3 / 20


def rel_err(out: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.float().abs().max().clamp_min(1e-30)
    return float((out.float() - reference.float()).abs().max() / scale)


def run_batch(args, layers, batch: int, prefill: bool = False) -> list[dict]:
    """Every path at one batch size (``prefill``: T tokens at once, eager paths only): a
    list of records (also printed)."""
    device = layers[0].experts.down_proj.device
    dtype = layers[0].experts.down_proj.dtype
    graphs = device.type == "cuda"
    generator = torch.Generator(device).manual_seed(batch)
    x = torch.randn(batch, args.hidden, device=device, dtype=dtype, generator=generator)
    hits: list[int] = []
    reference = decode_step(layers, partial(per_expert_forward, hits=hits), x)()
    expert_bytes = 3 * args.hidden * args.intermediate * dtype.itemsize
    routed_gb = sum(hits) * expert_bytes / 1e9
    read_gb = routed_gb + args.layers * args.shared * expert_bytes / 1e9
    base = dict(
        batch=batch,
        layers=args.layers,
        experts_hit_per_layer=sum(hits) / len(hits),
        routed_gb=round(routed_gb, 4),
    )
    records = []

    def report(path, ms, out, **extra):
        dense = next((r["ms"] for r in records if r["path"].startswith("dense")), None)
        records.append(
            dict(
                **base,
                path=path,
                **extra,
                ms=round(ms, 4),
                speedup_vs_dense=round(dense / ms, 2) if dense else None,
                gbps=round(read_gb / ms * 1e3, 1),
                max_rel_err=rel_err(out, reference),
            )
        )
        emit(**records[-1])

    if graphs:
        base["align_us"] = round(align_us(layers[0], x, args.top_k), 2)
    step = decode_step(layers, dense_forward, x)
    if prefill:
        pass  # every expert on every one of T tokens: not worth timing
    elif graphs:
        report("dense_graph", *graph_ms(step, args.repeats))
    else:  # no graphs on CPU: the dense path eager
        report("dense_eager", eager_ms(step, device, args.min_seconds), step())
    step = decode_step(layers, per_expert_forward, x)
    report("per_expert_eager", eager_ms(step, device, args.min_seconds), step())
    fused = decode_step(layers, DeepseekMoE.__call__, x)  # DeepseekMoE.forward as shipped
    report("fused_eager", eager_ms(fused, device, args.min_seconds), fused())
    if prefill or not graphs:
        return records
    report("fused_graph", *graph_ms(fused, args.repeats))
    if args.tiles:
        chosen = default_tiles(batch * args.top_k, args.experts)
        for tiles in [chosen, *(t for t in TILES if t != chosen)]:
            step = decode_step(layers, fused_forward(tiles), x)
            ms, out = graph_ms(step, args.repeats)
            report("fused_graph_tiles", ms, out, tiles=vars(tiles), default=tiles == chosen)
    return records


def run(args) -> list[dict]:
    device = torch.device(args.device)
    layers = make_layers(args, device, getattr(torch, args.dtype))
    records = []
    with torch.no_grad():
        for batch in args.batch:
            records += run_batch(args, layers, batch)
        for tokens in args.prefill:
            records += run_batch(args, layers, tokens, prefill=True)
    summary = {}
    for r in records:
        if r["path"] != "fused_graph_tiles":
            summary.setdefault(f"batch_{r['batch']}", {})[r["path"] + "_ms"] = r["ms"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    emit(path="summary", device=name, **summary)
    return records


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument(
        "--prefill", type=int, nargs="*", default=[2048], help="tokens of eager-only runs"
    )
    parser.add_argument("--layers", type=int, default=26, help="MoE layers (V2-Lite: 26)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--shared", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=20, help="graph replays timed")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="per eager path")
    parser.add_argument("--no-tiles", dest="tiles", action="store_false")
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())

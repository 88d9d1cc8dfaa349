"""The GEMV policy's trial (atom/kernels/gemv_policy.py): the candidate tiles of a layer
shape, its unfused and fused paths as callables of the weight, and the CUDA-graph timer."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from atom.kernels.activation import silu_and_mul
from atom.kernels.fp8_linear import fp8_linear
from atom.kernels.gemv import gemv, gemv_rms_norm, gemv_silu_and_mul
from atom.kernels.gemv_rope_kv import RopeKV, gemv_rope_kv
from atom.kernels.gemv_tiles import (
    GemvConfig,
    GemvSite,
    heuristic_config,
    quant_gemv_candidates,
)
from atom.kernels.rmsnorm import rms_norm
from atom.kernels.rotary_kv import rotary_kv_write

EPS = 1e-5
TOLERANCE = 2e-2  # a candidate whose output differs from the unfused one never wins


def candidates(site: GemvSite) -> list[GemvConfig]:
    """A few tiles per shape: one or two output rows per program (many programs, the
    weight streamed once) with K chunks of up to 1024, 1 to 8 warps, and the heuristic's
    choice (atom/kernels/gemv.py); with the norm prologue also 2 and 4 rows over narrower
    chunks (each program reads x, the residual and the norm weight again). The winners of
    the wider sweep (benchmarks/gemv_sweep.py) are of this family, and these narrow tiles
    stream large matrices near a streaming read's rate, where the heuristic's wider tiles
    fall well short (docs/benchmarks.md). An FP8 weight (1 byte an element) gets chunks
    twice as wide (the same bytes per tile: 16-byte loads), and the tiles the FP8 GEMV's
    tuner tries (atom/kernels/gemv_tiles.py quant_gemv_candidates, x loaded once as this
    kernel loads it for FP8): the fused kernel has every tile the unfused one may take."""
    fp8 = site.weight_dtype == "float8_e4m3fn"
    wide = 2 if fp8 else 1
    widest = 1 << math.ceil(math.log2(max(site.in_features, 1)))
    block_k = max(64, min(1024 * wide, widest))
    rows = site.rows // 2 if site.silu_mul else site.rows
    out = [
        GemvConfig(1, block_k, 1 if site.silu_mul else 2, 1),
        GemvConfig(1, block_k, 4, 1),
        GemvConfig(min(2, rows), block_k, 8, 1),
        heuristic_config(site.in_features, site.rows, site.silu_mul, site.weight_dtype),
    ]
    if site.norm:  # each program re-reads x (+ residual, norm weight): fewer, wider ones
        out += [GemvConfig(min(2, rows), min(512 * wide, block_k), 2, 1),
                GemvConfig(min(4, rows), min(256 * wide, block_k), 4, 1)]  # fmt: skip
    if fp8:
        tuned = quant_gemv_candidates(out[3], 0)  # around the FP8 heuristic (out[3])
        out += [config for config, x_once in tuned if x_once]
    return list(dict.fromkeys(out))


def cuda_seconds_per_call(run: Callable, weights: list, calls: int, replays: int) -> float:
    """Median over ``replays`` replays of one CUDA graph of ``calls`` calls rotating over
    ``weights``, per call (the in-graph launch gaps included, as in the decode graph)."""
    calls = max(calls, len(weights))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            run(weights[i % len(weights)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times) / calls


class TrialInputs:
    """x, a residual and a norm weight for one site, and its two paths as callables of
    the weight. A rope site's trial uses the step's RopeKV with no cache slot (-1). An FP8
    site (``weight_scale``: the layer's float32 scale per row, shared by every copy of the
    weight) runs unfused as the FP8 layer does: atom/kernels/fp8_linear.py's linear."""

    def __init__(
        self,
        site: GemvSite,
        weight: torch.Tensor,
        rope: RopeKV | None = None,
        weight_scale: torch.Tensor | None = None,
    ):
        self.site = site
        self.weight_scale = weight_scale
        generator = torch.Generator(weight.device).manual_seed(0)
        k, dtype, device = site.in_features, getattr(torch, site.dtype), weight.device
        self.x = torch.randn(1, k, device=device, dtype=dtype, generator=generator)
        self.residual = torch.randn(1, k, device=device, dtype=dtype, generator=generator)
        self.norm_weight = torch.ones(k, device=device, dtype=dtype)
        self.bias = None  # a bias site: one of the layer's shape on both paths
        if site.bias:
            rows = site.rows
            self.bias = torch.randn(rows, device=device, dtype=dtype, generator=generator)
        self.rope = None
        if rope is not None:  # nothing written: the trial must not touch the cache
            self.rope = dataclasses.replace(
                rope, slot_mapping=torch.full_like(rope.slot_mapping, -1)
            )

    def unfused(self):
        site, x, residual, norm_weight = self.site, self.x, self.residual, self.norm_weight
        rope, bias, scale = self.rope, self.bias, self.weight_scale

        def run(weight):
            h = rms_norm(x, norm_weight, EPS, residual)[0] if site.norm else x
            if scale is None:
                out = F.linear(h, weight, bias)
            else:  # what Fp8LinearMethod.apply runs on CUDA
                out = fp8_linear(h, weight, scale, (1, weight.shape[1]), bias)
            if rope is not None:
                q_size, kv_size = (
                    rope.num_q_heads * rope.head_dim,
                    rope.num_kv_heads * rope.head_dim,
                )
                q, k, v = out.split([q_size, kv_size, kv_size], dim=-1)
                heads = (rope.num_q_heads, rope.num_kv_heads, rope.num_kv_heads)
                q, k, v = (
                    t.view(1, n, rope.head_dim) for t, n in zip((q, k, v), heads, strict=True)
                )
                q = rotary_kv_write(rope.positions, q, k, v, rope.cos, rope.sin, rope.k_cache,
                                    rope.v_cache, rope.slot_mapping)  # fmt: skip
                return q.reshape(1, q_size)
            return silu_and_mul(out) if site.silu_mul else out

        run.config = None  # the unfused path
        return run

    def fused(self, config: GemvConfig):
        site, x, residual, norm_weight = self.site, self.x, self.residual, self.norm_weight
        rope, bias, scale = self.rope, self.bias, self.weight_scale

        def run(weight):
            if rope is not None:
                norm = (residual, norm_weight, EPS) if site.norm else None
                return gemv_rope_kv(x, weight, rope, norm, config, bias, scale)
            if site.norm:
                return gemv_rms_norm(
                    x, residual, norm_weight, EPS, weight, site.silu_mul, config, bias, scale
                )
            if site.silu_mul:
                return gemv_silu_and_mul(x, weight, config, scale)
            return gemv(x, weight, config, bias, scale)

        run.config = config  # which candidate (a test's timer reads it)
        return run

    def apart(self, config: GemvConfig):
        """A norm site's other way: the RMSNorm kernel, then the Triton GEMV without the
        norm prologue (``config``: a tile of that plain site); what the layer runs where
        the policy keeps the norm site unfused and the plain site takes the Triton GEMV."""
        site, x, residual, norm_weight = self.site, self.x, self.residual, self.norm_weight
        assert site.norm and self.rope is None

        bias, scale = self.bias, self.weight_scale

        def run(weight):
            h = rms_norm(x, norm_weight, EPS, residual)[0]
            if site.silu_mul:
                return gemv_silu_and_mul(h, weight, config, scale)
            return gemv(h, weight, config, bias, scale)

        run.config = config
        run.apart = True  # (a test's timer reads it)
        return run


def first_output(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result

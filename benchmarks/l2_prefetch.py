"""`python3 -m benchmarks.l2_prefetch`: a batch-1 decode step's kernel chain with and without
L2 prefetches of the next weights (benchmarks/candidates/l2_prefetch.py, a candidate
that lost), graph replay time.

The chain is a Llama shape's batch-1 decode step built from atom's own kernels on random
bf16 weights: per layer the qkv GEMV with its RMSNorm, paged decode attention over a short
context (and its split merge), o, gate_up + SiLU with its RMSNorm, down; then the LM head.
Variants insert a prefetch kernel at fixed places of each layer:

    none         no prefetch
    o@attn       o's weight, launched after the qkv GEMV (streams while attention runs)
    o@qkv        o's weight, launched before the qkv GEMV
    o@attn+qkv@down   also the next layer's qkv weight, launched before down
    o@attn+gu@o  also gate_up's first --gate-up-mb MB, launched before o
    all          the three

Each variant is timed as the median replay of one CUDA graph of the whole chain (PDL as the
engine's defaults: ``--no-pdl`` turns it off), interleaved over --rounds; the read limit is
the weight bytes over the streaming read measured in the same run. GPU only.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from atom.forward_context import forward_context
from atom.fusions import Fusions
from atom.kernels.decode_attention import paged_decode_attention
from atom.kernels.gemv import gemv, gemv_rms_norm
from atom.kernels.gemv_policy import GemvPolicy
from atom.kernels.gemv_tiles import heuristic_config
from benchmarks.candidates.l2_prefetch import l2_prefetch
from benchmarks.harness import emit, graph_us, streaming_bandwidth
from benchmarks.model_shapes import MATRIX

VARIANTS = ("none", "o@attn", "o@qkv", "o@attn+qkv@down", "o@attn+gu@o", "all")


class Chain:
    def __init__(self, fields: dict, context: int, gate_up_mb: int):
        self.hidden = h = fields["hidden_size"]
        inter = fields["intermediate_size"]
        self.heads = fields["num_attention_heads"]
        self.kv_heads = fields["num_key_value_heads"]
        self.head_dim = d = fields.get("head_dim", h // self.heads)
        layers = fields["num_hidden_layers"]
        dev, dt = "cuda", torch.bfloat16

        def w(*shape):
            return torch.randn(*shape, device=dev, dtype=dt) * shape[-1] ** -0.5

        qkv_rows = (self.heads + 2 * self.kv_heads) * d
        self.layers = [
            dict(qkv=w(qkv_rows, h), o=w(h, self.heads * d), gate_up=w(2 * inter, h),
                 down=w(h, inter), n1=torch.ones(h, device=dev, dtype=dt),
                 n2=torch.ones(h, device=dev, dtype=dt))
            for _ in range(layers)
        ]  # fmt: skip
        self.lm_head = w(fields["vocab_size"], h)
        self.weight_bytes = (
            sum(t.numel() * 2 for layer in self.layers for k, t in layer.items() if k[0] != "n")
            + self.lm_head.numel() * 2
        )
        block = 16
        blocks = -(-context // block)
        self.k_cache = torch.randn(blocks, block, self.kv_heads, d, device=dev, dtype=dt)
        self.v_cache = torch.randn_like(self.k_cache)
        self.tables = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
        self.lens = torch.tensor([context], device=dev, dtype=torch.int32)
        self.x = torch.randn(1, h, device=dev, dtype=dt)
        self.gate_up_bytes = gate_up_mb << 20
        # the GEMV policy's measured tiles, as the engine's (the heuristic's where it
        # keeps the unfused path: this chain runs the Triton GEMV everywhere)
        policy = GemvPolicy("measure", cache_path=None, budget_s=10.0)
        first = self.layers[0]
        act = torch.randn(1, inter, device=dev, dtype=dt)

        def tile(x, weight, silu=False, norm=False):
            config = policy.config_for(x, weight, silu, norm)
            return config or heuristic_config(weight.shape[1], weight.shape[0], silu)

        self.tiles = dict(
            qkv=tile(self.x, first["qkv"], norm=True), o=tile(self.x, first["o"]),
            gate_up=tile(self.x, first["gate_up"], True, True), down=tile(act, first["down"]),
            lm_head=tile(self.x, self.lm_head),
        )  # fmt: skip

    def step(self, variant: str):
        x, residual = self.x, None
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            if variant == "o@qkv":
                l2_prefetch(layer["o"])
            if residual is None:
                qkv, residual = gemv_rms_norm(x, None, layer["n1"], 1e-5, layer["qkv"],
                                              config=self.tiles["qkv"])  # fmt: skip
            else:
                qkv, residual = gemv_rms_norm(x, residual, layer["n1"], 1e-5, layer["qkv"],
                                              config=self.tiles["qkv"])  # fmt: skip
            if variant in ("o@attn", "o@attn+qkv@down", "o@attn+gu@o", "all"):
                l2_prefetch(layer["o"])
            q = qkv[:, : self.heads * self.head_dim].view(1, self.heads, self.head_dim)
            attn = paged_decode_attention(q, self.k_cache, self.v_cache, self.tables,
                                          self.lens, self.head_dim**-0.5)  # fmt: skip
            if variant in ("o@attn+gu@o", "all"):
                l2_prefetch(layer["gate_up"], self.gate_up_bytes)
            out = gemv(attn.view(1, -1), layer["o"], self.tiles["o"])
            act, residual = gemv_rms_norm(out, residual, layer["n2"], 1e-5, layer["gate_up"],
                                          silu_mul=True, config=self.tiles["gate_up"])  # fmt: skip
            if variant in ("o@attn+qkv@down", "all") and i + 1 < n:
                l2_prefetch(self.layers[i + 1]["qkv"])
            x = gemv(act, layer["down"], self.tiles["down"])
        return gemv(x, self.lm_head, self.tiles["lm_head"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(MATRIX))
    parser.add_argument("--context", type=int, default=384)
    parser.add_argument("--gate-up-mb", type=int, default=16)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--no-pdl", action="store_true")
    args = parser.parse_args(argv)
    bandwidth = streaming_bandwidth()
    emit(case="stream_bandwidth", **bandwidth)
    chain = Chain(MATRIX[args.shape][1], args.context, args.gate_up_mb)
    fusions = Fusions(pdl=not args.no_pdl)
    emit(case="tiles", **{name: list(vars(t).values()) for name, t in chain.tiles.items()})
    limit_us = chain.weight_bytes / bandwidth["stream_read"] * 1e6
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    with forward_context(None, fusions):
        reference = chain.step("none").float()
        for variant in args.variants:  # a prefetch changes no result
            assert torch.equal(chain.step(variant).float(), reference), variant
        for _ in range(args.rounds):
            for variant in args.variants:
                times[variant].append(graph_us(lambda v=variant: chain.step(v), args.repeats))
    base = statistics.median(times[args.variants[0]])
    for variant, values in times.items():
        us = statistics.median(values)
        emit(case="chain", shape=args.shape, variant=variant, context=args.context,
             pdl=not args.no_pdl, us=round(us, 1), all_us=[round(t, 1) for t in values],
             speedup=round(base / us, 3), read_limit_us=round(limit_us, 1),
             of_read_limit=round(limit_us / us, 3))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

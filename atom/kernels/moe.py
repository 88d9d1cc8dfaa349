"""Routed experts of an MoE layer: a Triton grouped GEMM over tokens sorted by expert, beside
its torch reference.

Shapes and dtypes (T tokens, k experts per token, E experts, hidden H, intermediate I):
    x             [T, H] fp32/bf16/fp16
    topk_weights  [T, k] fp32 (the routers' dtype) or x's dtype
    topk_ids      [T, k] int32/int64, ids in [0, E)
    gate_up_proj  [E, 2I, H] x's dtype: gate rows [0, I), up rows [I, 2I)
    down_proj     [E, H, I] x's dtype
    out           [T, H] x's dtype

    out[t] = sum_j topk_weights[t, j] * down[e] @ act(gate_up[e] @ x[t]),  e = topk_ids[t, j]
    act(gate | up) = SiLU(gate) * up; with swiglu_limit L (DeepSeek-V4) gate is clamped to
    at most L and up to [-L, L] first.

Numerics of the reference follow HF transformers' expert loop (DeepseekV2Experts,
DeepseekV4Experts): each expert's GEMMs in x's dtype, the product with the routing weight in
the weight's dtype then rounded to x's dtype, and the per-token sum in x's dtype in
ascending expert order.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def swiglu_reference(gate_up: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """[..., 2I] (gate | up) -> SiLU(gate) * up, gate clamped to <= L and up to [-L, L]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.silu(gate) * up


def routed_experts_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Pure-torch routed experts: the (token, k) pairs sorted by expert, one GEMM pair per
    expert segment (work proportional to T * k). Reads the segment sizes on the host, so it
    is not CUDA-graph capturable; ``fused_moe`` is."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat_ids = topk_ids.reshape(-1)
    # stable: inside an expert, pairs stay in token order (each token picks an expert once)
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order, None]
    counts = torch.bincount(flat_ids, minlength=gate_up_proj.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        hidden = swiglu_reference(F.linear(x[tokens[rows]], gate_up_proj[expert]), swiglu_limit)
        y = F.linear(hidden, down_proj[expert]) * weights[rows]
        # one add per expert, in expert order, like HF (one index_add_ over all the pairs
        # rounds a bf16 sum differently)
        out.index_add_(0, tokens[rows], y.to(x.dtype))
        start += count
    return out

"""Routed experts of a mixture-of-experts layer, shared by every MoE family (DeepSeek-V2/V3,
DeepSeek-V4).

``routed_experts`` does work proportional to ``num_tokens * top_k``. It runs the torch
reference of atom/kernels/moe.py (one GEMM per expert segment, in expert order, as HF's
expert loop); the Triton grouped GEMM for CUDA (no host sync, CUDA-graph capturable) follows
on this branch.
"""

from __future__ import annotations

import torch

from atom.kernels.moe import routed_experts_reference


def routed_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` as ``[T, H]`` in x's dtype.

    x [T, H]; topk_weights [T, k] (fp32 from the routers, or x's dtype); topk_ids [T, k]
    integer ids in [0, E); gate_up_proj [E, 2I, H] (gate rows then up rows); down_proj
    [E, H, I]. An expert is ``down @ (SiLU(gate) * up)`` with ``gate, up = gate_up @ x``; with
    ``swiglu_limit`` (DeepSeek-V4) gate is clamped to at most the limit and up to
    [-limit, limit] before the activation.
    """
    # TODO(this branch): the Triton grouped GEMM on CUDA (graph capturable, no host sync).
    return routed_experts_reference(
        x, topk_weights, topk_ids, gate_up_proj, down_proj, swiglu_limit
    )

"""Routed experts of a mixture-of-experts layer, shared by every MoE family (DeepSeek-V2/V3,
DeepSeek-V4).

``routed_experts`` does work proportional to ``num_tokens * top_k`` and never syncs the host
on CUDA: there it runs atom/kernels/moe.py's Triton grouped GEMM over tokens sorted by expert
(fixed-size buffers, so eager mode and CUDA-graph capture take the same path); on CPU it runs
the torch reference of the same math (one GEMM per expert segment, in expert order, as HF's
expert loop, so fp32 outputs equal HF's bit for bit).
"""

from __future__ import annotations

import torch

from atom.kernels.moe import Fp8Scales, SharedExpert, fused_moe, routed_experts_reference
from atom.kernels.moe_combine import add_shared
from atom.kernels.platform import use_cuda_path


def routed_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    swiglu_limit: float | None = None,
    weight_before_down: bool = False,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    fp8_scales: Fp8Scales | None = None,
    shared_expert: SharedExpert | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` as ``[T, H]`` in x's dtype.

    x [T, H]; topk_weights [T, k] (fp32 from the routers, or x's dtype); topk_ids [T, k]
    integer ids in [0, E); gate_up_proj [E, 2I, H] (gate rows then up rows); down_proj
    [E, H, I]. An expert is ``down @ (SiLU(gate) * up)`` with ``gate, up = gate_up @ x``; with
    ``swiglu_limit`` (DeepSeek-V4) gate is clamped to at most the limit and up to
    [-limit, limit] before the activation. ``weight_before_down`` (DeepSeek-V4.1): the weight
    multiplies the activation, the input of ``down`` (same result, other rounding points).
    ``shared`` [T, H] (a shared expert's output) is added (DeepSeek-V2/V3/V4/V4.1), or scaled
    by ``sigmoid(x @ shared_gate.T)`` with ``shared_gate`` [1, H] (Qwen3-Next): on CUDA in
    the launch that sums over k (the same rounding points as the separate add).
    ``fp8_scales``: both weights are float8_e4m3fn with these block scales (DeepSeek-V2/V3's
    FP8 experts), which the CUDA path's kernels read as they are; the reference dequantizes
    every expert first. ``shared_expert`` (instead of ``shared``): the shared expert's
    forward and, where it is a routed expert's math, its weights, which the per-pair decode
    GEMV on CUDA runs as one more pair a token (``atom.kernels.moe.SharedExpert``).
    """
    if use_cuda_path(x):
        args = (x, topk_weights, topk_ids, gate_up_proj, down_proj, swiglu_limit)
        options = dict(weight_before_down=weight_before_down, fp8_scales=fp8_scales)
        shared_options = dict(shared=shared, shared_gate=shared_gate, shared_expert=shared_expert)
        return fused_moe(*args, **options, **shared_options)
    if shared_expert is not None:
        shared = shared_expert.forward(x)
    if fp8_scales is not None:
        gate_up_proj, down_proj = fp8_scales.dequantize(gate_up_proj, down_proj, x.dtype)
    args = (x, topk_weights, topk_ids, gate_up_proj, down_proj, swiglu_limit)
    routed = routed_experts_reference(*args, weight_before_down=weight_before_down)
    return routed if shared is None else add_shared(routed, shared, x, shared_gate)

"""MoE routing: a router's logits to (weights, expert ids) in one launch, for the two scoring
rules in use (DeepSeek-V4's sqrtsoftplus and the softmax of Qwen3-Next / Qwen3-MoE).

Shapes and dtypes (T tokens, E routed experts, k = num_experts_per_tok):
    logits    [T, E] the gate's output (``F.linear(x, gate.weight)``), x's dtype; rows may be
              strided, the experts unit-stride
    bias      [E] fp32 ``e_score_correction_bias`` (V4 score layers), for the choice only
    input_ids [T] int, tid2eid [vocab, k] int (V4 hash layers: the experts come from the token)
    weights   [T, k] out, logits' dtype
    ids       [T, k] out, int64, in choice order (best first; hash layers: tid2eid's order)

DeepSeek-V4 (``v4_route``; DeepSeek-V4.1 with ``temperature``, its fp32 logits / gate_temp):
    scores  = sqrt(softplus(logits / temperature))       (rounded to the dtype after each op)
    ids     = top-k of scores + bias  (score layers)  |  tid2eid[input_ids]  (hash layers)
    weights = scores[ids] / (sum_j scores[ids_j] + 1e-20) * routed_scaling_factor
Softmax (``softmax_route``, Qwen3-Next's `Qwen3NextSparseMoeBlock`):
    scores  = softmax(logits) in fp32
    ids     = top-k of scores
    weights = scores[ids] (/ sum_j scores[ids_j] with ``renormalize``), fp32, rounded once

Tie rule (docs/architecture.md "Top-k ties", the indexer's): among equal choice values the
lower expert index wins, and the ids come out best first. The references get it from a stable
descending sort; the kernel takes k times the maximum and, among equal maxima, the lowest
index. HF's ``torch.topk`` leaves ties to the implementation.

Numerics as the models' torch ops. V4 (`DeepseekV4MoE.forward`): softplus (threshold 20: the
input itself above it) and sqrt in fp32, each rounded to the logits' dtype; the choice in
fp32; the weights' sum in fp32 rounded once, the division and the scaling each rounded.
Softmax: all in fp32 (max, exp, sum, division; the chosen weights' sum and division), one
rounding to the logits' dtype at the end. The GPU's fp32 ``exp``/``log`` may differ from
torch's in the last bit, and sums run in another order, which can flip a last bf16 bit;
Triton's interpreter truncates fp32 -> bf16 where the GPU rounds.

One program per token (grid ``(T,)``): no runtime length reaches the kernel, so no length
specializes it; geometry (E, k, the scoring rule) is constexpr; the scaling factor is fixed by
the model. No host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from atom.kernels.platform import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


SQRT_SOFTPLUS, SOFTMAX = 0, 1  # the kernel's SCORING


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] x's dtype
    bias_ptr,  # [E] fp32 (score layers)
    input_ids_ptr,  # [T] (hash layers)
    tid2eid_ptr,  # [vocab, K] (hash layers), unit-stride rows
    weights_ptr,  # out [T, K] logits' dtype, contiguous
    ids_ptr,  # out [T, K] int64, contiguous
    stride_logits_row,
    scale,  # routed_scaling_factor (V4)
    temperature,  # the logits' divisor (V4.1's gate_temp; 1.0: V4, softmax)
    E: tl.constexpr,
    E_P2: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HASH: tl.constexpr,  # V4 hash layers
    SCORING: tl.constexpr,  # SQRT_SOFTPLUS (V4) or SOFTMAX
    RENORMALIZE: tl.constexpr,  # SOFTMAX: divide the chosen weights by their sum
):
    token = tl.program_id(0).to(tl.int64)
    dtype = weights_ptr.dtype.element_ty
    experts = tl.arange(0, E_P2)
    in_e = experts < E
    x = tl.load(logits_ptr + token * stride_logits_row + experts, mask=in_e, other=0.0)
    x = tl.div_rn(x.to(tl.float32), temperature)  # IEEE division, as torch's (x / 1.0 == x)
    if SCORING == 1:  # SOFTMAX, in fp32 (torch.softmax(dtype=float) divides by the sum)
        x = tl.where(in_e, x, float("-inf"))
        exp = tl.where(in_e, tl.exp(x - tl.max(x, axis=0)), 0.0)
        scores = exp / tl.sum(exp, axis=0)
    else:
        # softplus = max(x, 0) + log1p(exp(-|x|)); log1p(u) = log(w) * u / (w - 1), w = 1 + u
        # (accurate for small u, where log(1 + u) alone loses the low bits)
        u = tl.exp(-tl.abs(x))
        w = 1.0 + u
        exact = w == 1.0
        log1p = tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))
        softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p).to(dtype).to(tl.float32)
        scores = tl.sqrt(softplus).to(dtype).to(tl.float32)

    slots = tl.arange(0, K_P2)
    chosen = tl.zeros([K_P2], dtype=tl.int64)
    picked = tl.zeros([K_P2], dtype=tl.float32)
    if HASH:
        tid = tl.load(input_ids_ptr + token).to(tl.int64)
        chosen = tl.load(tid2eid_ptr + tid * K + slots, mask=slots < K, other=0).to(tl.int64)
        for j in tl.static_range(K):
            expert = tl.sum(tl.where(slots == j, chosen, 0), axis=0)
            value = tl.sum(tl.where(experts == expert, scores, 0.0), axis=0)
            picked = tl.where(slots == j, value, picked)
    else:
        if SCORING == 1:
            choice = tl.where(in_e, scores, float("-inf"))
        else:
            bias = tl.load(bias_ptr + experts, mask=in_e, other=0.0).to(tl.float32)
            choice = tl.where(in_e, scores + bias, float("-inf"))
        for j in tl.static_range(K):
            best = tl.max(choice, axis=0)
            # among equal maxima the lowest index (the tie rule); E - 1 if none matched (NaN)
            expert = tl.minimum(tl.min(tl.where(choice == best, experts, E_P2), axis=0), E - 1)
            value = tl.sum(tl.where(experts == expert, scores, 0.0), axis=0)
            chosen = tl.where(slots == j, expert.to(tl.int64), chosen)
            picked = tl.where(slots == j, value, picked)
            choice = tl.where(experts == expert, float("-inf"), choice)

    in_k = slots < K
    if SCORING == 1:
        weights = picked
        if RENORMALIZE:
            weights = picked / tl.sum(tl.where(in_k, picked, 0.0), axis=0)
    else:
        total = tl.sum(tl.where(in_k, picked, 0.0), axis=0).to(dtype).to(tl.float32)
        denominator = (total + 1e-20).to(dtype).to(tl.float32)
        weights = (picked / denominator).to(dtype).to(tl.float32)
        weights = weights * scale
    tl.store(weights_ptr + token * K + slots, weights.to(dtype), mask=in_k)
    tl.store(ids_ptr + token * K + slots, chosen, mask=in_k)


def v4_route(
    logits: torch.Tensor,
    top_k: int,
    scale: float,
    bias: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, ids [T, k] int64) from logits [T, E]: with
    ``bias`` the top-k choice (score layers), with ``input_ids`` and ``tid2eid`` the hash
    layers' experts; the logits divided by ``temperature`` first (DeepSeek-V4.1's gate_temp,
    on fp32 logits). One Triton launch; the torch reference where Triton does not run."""
    if not use_triton(logits):
        return v4_route_reference(logits, top_k, scale, bias, input_ids, tid2eid, temperature)
    tokens, experts = logits.shape
    hashed = tid2eid is not None
    if hashed == (bias is not None):
        raise ValueError("v4_route: pass either bias (score layers) or tid2eid (hash layers)")
    assert logits.stride(-1) == 1, "the logits' experts must be unit-stride"
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    if hashed:
        assert tid2eid.shape[1] == top_k and tid2eid.stride(-1) == 1, "tid2eid [vocab, k]"
        tid2eid = tid2eid if tid2eid.stride(0) == top_k else tid2eid.contiguous()
    _launch(
        logits, bias if bias is not None else logits,
        input_ids if hashed else logits, tid2eid if hashed else logits,
        weights, ids, float(scale), float(temperature), hashed, SQRT_SOFTPLUS, False,
    )  # fmt: skip
    return weights, ids


def _launch(logits, bias, input_ids, tid2eid, weights, ids, scale, temperature, hashed, scoring,
            renormalize):  # fmt: skip
    tokens, experts = logits.shape
    top_k = weights.shape[1]
    _route_kernel[(tokens,)](
        logits, bias, input_ids, tid2eid, weights, ids, logits.stride(0), scale, temperature,
        E=experts, E_P2=triton.next_power_of_2(experts), K=top_k,
        K_P2=triton.next_power_of_2(top_k), HASH=hashed, SCORING=scoring,
        RENORMALIZE=renormalize, num_warps=1 if experts <= 256 else 4,
    )  # fmt: skip


def v4_route_reference(logits, top_k, scale, bias=None, input_ids=None, tid2eid=None,
                       temperature=1.0):  # fmt: skip
    """The model's torch ops, the choice by a stable descending sort (the tie rule)."""
    if temperature != 1.0:
        logits = logits / temperature
    scores = F.softplus(logits).sqrt()
    if tid2eid is not None:
        ids = tid2eid[input_ids].long()
    else:
        choice = scores + bias
        ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def softmax_route(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, ids [T, k] int64, best first) from logits
    [T, E]: softmax in fp32, top-k, with ``renormalize`` the chosen weights over their sum
    (Qwen3-Next's ``norm_topk_prob``). One Triton launch; the torch reference where Triton
    does not run."""
    if not use_triton(logits):
        return softmax_route_reference(logits, top_k, renormalize)
    tokens, _ = logits.shape
    assert logits.stride(-1) == 1, "the logits' experts must be unit-stride"
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    _launch(logits, logits, logits, logits, weights, ids, 1.0, 1.0, False, SOFTMAX, renormalize)
    return weights, ids


def softmax_route_reference(logits, top_k, renormalize):
    """The model's torch ops, the choice by a stable descending sort (the tie rule)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids

"""The end of an MoE layer in one launch: the routed experts' per-pair outputs summed over k,
plus the shared expert's output, optionally scaled by a sigmoid gate (Qwen3-Next's
``sigmoid(shared_expert_gate(x)) * shared``).

Shapes and dtypes (T tokens, k experts per token, hidden H):
    per_pair     [T, k, H] x's dtype, each token's k rows contiguous (the down kernel's output,
                 times its weight; with the shared expert as one more pair, a [T, k + 1, H]
                 buffer's first k rows, ``shared`` its last)
    shared       [T, H] x's dtype, unit stride inside a row
    x            [T, H] the layer's input (the gate's), unit stride inside a row
    shared_gate  [1, H] the gate's weight (``nn.Linear(H, 1)``), x's dtype, or None
    out          [T, H] x's dtype

    routed = sum_j per_pair[:, j]                            (fp32, rounded once: torch's sum)
    out    = routed + sigmoid(x @ shared_gate.T) * shared    (shared_gate)
           | routed + shared                                  (no gate)
each product and the sum rounded to x's dtype where torch rounds (the dot, the sigmoid, the
scaled shared output, the sum). The dot and the k-sum run in another order than torch's: fp32
may differ in the last bit, which can flip a last bf16 bit.

Grid (T, H / BLOCK_H): each program recomputes the gate's dot (H products, L2-resident). No
runtime length reaches the kernel; H, k and the gate are constexpr. No host sync.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from atom.kernels.pdl import pdl_chain_launch, pdl_wait_and_release
from atom.kernels.platform import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


@triton.jit
def _moe_combine_kernel(
    per_pair_ptr,  # [T, K, H], unit stride inside a token's K rows
    shared_ptr,  # [T, H]
    x_ptr,  # [T, H] (HAS_GATE)
    gate_ptr,  # [H] (HAS_GATE)
    out_ptr,  # out [T, H] contiguous
    stride_pair_token,
    stride_shared,
    stride_x,
    HIDDEN: tl.constexpr,
    K: tl.constexpr,
    HAS_GATE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,  # the gate's dot, per step
    PDL: tl.constexpr = 0,  # programmatic dependent launch (atom/kernels/pdl.py)
):
    pdl_wait_and_release(PDL)  # the per-pair rows: the down GEMV's, just before
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < HIDDEN
    dtype = out_ptr.dtype.element_ty

    routed = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        row = per_pair_ptr + token * stride_pair_token + j * HIDDEN
        routed += tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    routed = routed.to(dtype).to(tl.float32)
    shared = tl.load(shared_ptr + token * stride_shared + offs, mask=mask, other=0.0)
    shared = shared.to(tl.float32)
    if HAS_GATE:
        dot = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, HIDDEN, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            x = tl.load(x_ptr + token * stride_x + d, mask=d < HIDDEN, other=0.0)
            w = tl.load(gate_ptr + d, mask=d < HIDDEN, other=0.0)
            dot += x.to(tl.float32) * w.to(tl.float32)
        logit = tl.sum(dot, axis=0).to(dtype).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-logit))).to(dtype).to(tl.float32)
        shared = (gate * shared).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * HIDDEN + offs, (routed + shared).to(dtype), mask=mask)


def moe_combine(
    per_pair: torch.Tensor,
    shared: torch.Tensor,
    x: torch.Tensor,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``per_pair.sum(1) + sigmoid(x @ shared_gate.T) * shared`` (``+ shared`` without a
    gate) as [T, H] in x's dtype, one launch; the torch reference where Triton does not run."""
    if not use_triton(per_pair):
        return moe_combine_reference(per_pair, shared, x, shared_gate)
    tokens, top_k, hidden = per_pair.shape
    assert per_pair.stride(2) == 1 and per_pair.stride(1) == hidden
    assert shared.stride(-1) == 1 and x.stride(-1) == 1
    out = torch.empty(tokens, hidden, dtype=per_pair.dtype, device=per_pair.device)
    if tokens == 0:
        return out
    if shared_gate is not None:
        assert shared_gate.shape == (1, hidden) and shared_gate.is_contiguous()
    block_h = min(512, triton.next_power_of_2(hidden))
    pdl, launch = pdl_chain_launch(per_pair)
    _moe_combine_kernel[(tokens, triton.cdiv(hidden, block_h))](
        per_pair, shared, x, shared_gate if shared_gate is not None else x, out,
        per_pair.stride(0), shared.stride(0), x.stride(0),
        HIDDEN=hidden, K=top_k, HAS_GATE=shared_gate is not None, BLOCK_H=block_h,
        BLOCK_D=min(1024, triton.next_power_of_2(hidden)), PDL=pdl, num_warps=4, **launch,
    )  # fmt: skip
    return out


def moe_combine_reference(per_pair, shared, x, shared_gate=None):
    """The models' torch ops: the routed sum, then the (gated) shared output added."""
    return add_shared(per_pair.sum(dim=1), shared, x, shared_gate)


def add_shared(routed, shared, x, shared_gate=None):
    """``routed + sigmoid(F.linear(x, shared_gate)) * shared`` (Qwen3-Next), or
    ``routed + shared`` without a gate."""
    if shared_gate is None:
        return routed + shared
    return routed + torch.sigmoid(F.linear(x, shared_gate)) * shared

"""The elementwise work of a GDN layer (Qwen3-Next's linear attention) around its conv and
delta rule, one launch each: the projections split into the conv's input, the decay g and
beta (``gdn_split``); the gated RMSNorm of the delta rule's output (``gated_rms_norm``).

Shapes and dtypes (T tokens, Hk key heads, Hv = R * Hk value heads, head dims Dk, Dv):
    qkvz      [T, Hk * (2 Dk + 2 R Dv)] in_proj_qkvz's output, x's dtype, per key head h the
              group q_h | k_h | v (R heads) | z (R heads) (HF's order)
    ba        [T, Hk * 2 R] in_proj_ba's output, per key head b (R heads) | a (R heads)
    A_log, dt_bias [Hv] the layer's parameters
    mixed     [T, 2 Hk Dk + Hv Dv] out: q | k | v, each head after head (the conv's input)
    g, beta   [T, Hv] out, fp32: g = -exp(A_log) * softplus(a + dt_bias) (fp32),
              beta = sigmoid(b) rounded to x's dtype (HF's bf16 sigmoid), held in fp32
    x         [T, Hv, Dv] the delta rule's output; z [T, Hk, R, Dv] a strided view of qkvz
    out       [T, Hv * Dv]: RMSNorm(x) * weight * silu(z) per (token, value head)

Numerics as the model's torch ops (`Qwen3NextGatedDeltaNet.forward`, `GatedRMSNorm`): softplus
with threshold 20 (the input itself above it), log1p kept accurate for small inputs; the norm
in fp32, rounded to the dtype, times the weight (rounded), times silu(z) in fp32, rounded
once. The GPU's fp32 ``exp``/``log`` may differ from torch's in the last bit.

Rows come from the grid: no runtime length reaches a kernel (geometry is constexpr; row
strides and eps are fixed by the model). No host sync: CUDA-graph capturable.
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
def _gdn_split_kernel(
    qkvz_ptr,  # [T, Hk * GROUP_WIDTH]
    ba_ptr,  # [T, Hk * 2R]
    a_log_ptr,  # [Hv]
    dt_bias_ptr,  # [Hv]
    mixed_ptr,  # out [T, 2 Hk Dk + Hv Dv] contiguous
    g_ptr,  # out [T, Hv] fp32 contiguous
    beta_ptr,  # out [T, Hv] fp32 contiguous
    stride_qkvz,
    stride_ba,
    NUM_K_HEADS: tl.constexpr,
    RATIO: tl.constexpr,  # R = Hv // Hk
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_HV: tl.constexpr,  # next power of two >= Hv
    PDL: tl.constexpr = 0,  # programmatic dependent launch (atom/kernels/pdl.py)
):
    # Program (t, c): channels [c * BLOCK_C, ...) of token t's mixed row; program (t, 0)
    # also writes the token's g and beta.
    pdl_wait_and_release(PDL)  # qkvz and ba: the projection's, just before
    token = tl.program_id(0).to(tl.int64)
    key_dim: tl.constexpr = NUM_K_HEADS * DK
    value_width: tl.constexpr = RATIO * DV  # one key head's v (or z) channels
    group_width: tl.constexpr = 2 * DK + 2 * value_width
    channels: tl.constexpr = 2 * key_dim + NUM_K_HEADS * value_width
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    is_q = c < key_dim
    is_k = (c >= key_dim) & (c < 2 * key_dim)
    qk = tl.where(is_k, c - key_dim, c)
    v = c - 2 * key_dim
    source = tl.where(
        is_q | is_k,
        (qk // DK) * group_width + tl.where(is_k, DK, 0) + qk % DK,
        (v // value_width) * group_width + 2 * DK + v % value_width,
    )
    mask = c < channels
    values = tl.load(qkvz_ptr + token * stride_qkvz + source, mask=mask, other=0.0)
    tl.store(mixed_ptr + token * channels + c, values, mask=mask)

    if tl.program_id(1) == 0:
        dtype = mixed_ptr.dtype.element_ty
        heads = tl.arange(0, BLOCK_HV)
        in_h = heads < NUM_K_HEADS * RATIO
        b_at = (heads // RATIO) * 2 * RATIO + heads % RATIO
        b = tl.load(ba_ptr + token * stride_ba + b_at, mask=in_h, other=0.0).to(tl.float32)
        a = tl.load(ba_ptr + token * stride_ba + b_at + RATIO, mask=in_h, other=0.0)
        a_log = tl.load(a_log_ptr + heads, mask=in_h, other=0.0).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + heads, mask=in_h, other=0.0).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-b))).to(dtype).to(tl.float32)
        x = a.to(tl.float32) + dt_bias
        # softplus = log1p(exp(x)) below 20; log1p(u) = log(w) * u / (w - 1), w = 1 + u
        # (accurate for small u, where log(1 + u) alone loses the low bits)
        u = tl.exp(tl.minimum(x, 20.0))
        w = 1.0 + u
        exact = w == 1.0
        log1p = tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))
        softplus = tl.where(x > 20.0, x, log1p)
        g = -tl.exp(a_log) * softplus
        tl.store(g_ptr + token * NUM_K_HEADS * RATIO + heads, g, mask=in_h)
        tl.store(beta_ptr + token * NUM_K_HEADS * RATIO + heads, beta, mask=in_h)


def gdn_split(
    qkvz: torch.Tensor,
    ba: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mixed [T, 2 Hk Dk + Hv Dv], g [T, Hv] fp32, beta [T, Hv] fp32) from the projections'
    outputs (see the module doc); one launch, the torch reference where Triton does not run."""
    if not use_triton(qkvz):
        return gdn_split_reference(qkvz, ba, a_log, dt_bias, num_k_heads, head_k_dim, head_v_dim)
    tokens = qkvz.shape[0]
    num_v_heads = a_log.shape[0]
    ratio, dk, dv = num_v_heads // num_k_heads, head_k_dim, head_v_dim
    channels = 2 * num_k_heads * dk + num_v_heads * dv
    assert qkvz.shape[1] == num_k_heads * (2 * dk + 2 * ratio * dv) and qkvz.stride(1) == 1
    assert ba.shape[1] == 2 * num_v_heads and ba.stride(1) == 1
    mixed = torch.empty(tokens, channels, dtype=qkvz.dtype, device=qkvz.device)
    g = torch.empty(tokens, num_v_heads, dtype=torch.float32, device=qkvz.device)
    beta = torch.empty_like(g)
    if tokens == 0:
        return mixed, g, beta
    block_c = min(1024, triton.next_power_of_2(channels))
    pdl, launch = pdl_chain_launch(qkvz)
    _gdn_split_kernel[(tokens, triton.cdiv(channels, block_c))](
        qkvz, ba, a_log, dt_bias, mixed, g, beta, qkvz.stride(0), ba.stride(0),
        NUM_K_HEADS=num_k_heads, RATIO=ratio, DK=dk, DV=dv, BLOCK_C=block_c,
        BLOCK_HV=triton.next_power_of_2(num_v_heads), PDL=pdl, num_warps=4, **launch,
    )  # fmt: skip
    return mixed, g, beta


def gdn_split_reference(qkvz, ba, a_log, dt_bias, num_k_heads, head_k_dim, head_v_dim):
    """The model's torch ops (`Qwen3NextGatedDeltaNet.forward`), beta held in fp32."""
    count, num_v_heads = qkvz.shape[0], a_log.shape[0]
    ratio, dk, dv = num_v_heads // num_k_heads, head_k_dim, head_v_dim
    q, k, v, _ = qkvz.view(count, num_k_heads, -1).split([dk, dk, ratio * dv, ratio * dv], -1)
    b, a = ba.view(count, num_k_heads, -1).split([ratio, ratio], -1)
    mixed = torch.cat([q.reshape(count, -1), k.reshape(count, -1), v.reshape(count, -1)], -1)
    beta = b.reshape(count, -1).sigmoid()
    g = -a_log.float().exp() * F.softplus(a.reshape(count, -1).float() + dt_bias)
    return mixed, g, beta.float()


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,  # [T * Hv, Dv] contiguous
    z_ptr,  # [T, Hk, R, Dv] (token, key head strided; R, Dv packed)
    weight_ptr,  # [Dv]
    out_ptr,  # out [T * Hv, Dv] contiguous
    stride_z_token,
    stride_z_head,
    eps,
    NUM_V_HEADS: tl.constexpr,
    RATIO: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    row = tl.program_id(0).to(tl.int64)  # token * Hv + value head
    token = row // NUM_V_HEADS
    head = row % NUM_V_HEADS
    d = tl.arange(0, BLOCK_V)
    mask = d < DV
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weight_ptr + d, mask=mask, other=0.0).to(tl.float32)  # a parameter
    pdl_wait_and_release(PDL)  # x: the delta rule's, just before
    x = tl.load(x_ptr + row * DV + d, mask=mask, other=0.0).to(tl.float32)
    z_row = z_ptr + token * stride_z_token + (head // RATIO) * stride_z_head
    z = tl.load(z_row + (head % RATIO) * DV + d, mask=mask, other=0.0).to(tl.float32)
    h = x * tl.rsqrt(tl.sum(x * x, axis=0) / DV + eps)
    h = (weight * h.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out = h * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + row * DV + d, out.to(dtype), mask=mask)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x [T, Hv, Dv] (contiguous), z [T, Hk, R, Dv] (unit-stride R, Dv: a view of qkvz),
    weight [Dv] -> [T, Hv * Dv] in x's dtype; one launch, the torch reference where Triton
    does not run."""
    if not use_triton(x):
        return gated_rms_norm_reference(x, z, weight, eps)
    tokens, num_v_heads, dv = x.shape
    ratio = z.shape[2]
    assert x.is_contiguous() and z.shape == (tokens, num_v_heads // ratio, ratio, dv)
    assert z.stride(3) == 1 and z.stride(2) == dv
    out = torch.empty(tokens, num_v_heads * dv, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    pdl, launch = pdl_chain_launch(x)
    _gated_rms_norm_kernel[(tokens * num_v_heads,)](
        x, z, weight, out, z.stride(0), z.stride(1), float(eps),
        NUM_V_HEADS=num_v_heads, RATIO=ratio, DV=dv, BLOCK_V=triton.next_power_of_2(dv),
        PDL=pdl, num_warps=1 if dv <= 256 else 4, **launch,
    )  # fmt: skip
    return out


def gated_rms_norm_reference(x, z, weight, eps):
    """HF's Qwen3NextRMSNormGated over rows of Dv (`GatedRMSNorm.forward`)."""
    dv, dtype = x.shape[-1], x.dtype
    h = x.reshape(-1, dv).float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    out = (h * F.silu(z.reshape(-1, dv).float())).to(dtype)
    return out.reshape(x.shape[0], -1)

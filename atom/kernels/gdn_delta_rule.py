"""The gated delta rule of Qwen3-Next's linear-attention layers (GDN).

Per value head h and token t, with q, k L2-normalised (fp32) and q scaled by Dk^-0.5:

    S <- S * exp(g_t)                      (decay, g_t <= 0)
    S <- S + k_t (beta_t * (v_t - k_t^T S))^T   (delta-rule write, S is [Dk, Dv])
    o_t = q_t^T S

Shapes: q, k ``[T, Hk, Dk]``; v ``[T, Hv, Dv]`` (Hv a multiple of Hk: each q/k head serves
Hv // Hk consecutive value heads); g, beta ``[T, Hv]`` fp32; the state ``[num_state_slots + 1,
Hv, Dk, Dv]`` fp32, one row per state slot (atom/model_engine/state_slots.py), the last row
scratch for padded rows (slot -1). ``fresh[b]`` != 0: sequence b starts at position 0 this
step, its state is taken as zero (a reused slot keeps the previous owner's state).

- ``recurrent_gated_delta_rule_*``: one token per row (decode); static shapes, CUDA-graph
  capturable.
- ``chunk_gated_delta_rule_reference``: varlen prefill over ``cu_seqlens``, any start
  position (chunked prefill continues the state), the chunked (UT-transform) form of HF
  transformers' ``torch_chunk_gated_delta_rule`` per sequence.
The Triton kernel (`_gated_delta_rule_kernel`, below) runs the recurrent form for both: one
program per (sequence, value head, block of Dv) keeps its [Dk, BLOCK_V] slice of the state in
registers and walks the sequence's tokens; it is exact for any chunk boundary and start
position but sequential in the tokens: long prefills run the chunked Triton form instead
(atom/kernels/gdn_chunk.py, against `chunk_gated_delta_rule_reference`). No runtime length is a scalar argument: rows come from the grid, sequence bounds
from ``cu_seqlens`` in device memory. Geometry (constexpr): heads, head dims, tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels.pdl import pdl_chain_launch, pdl_wait_and_release
from atom.kernels.platform import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF/FLA's l2norm (x * rsqrt(sum x^2 + eps)), in x's dtype."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, divide: bool = False):
    """[T, Hk, Dk] -> fp32 [T, Hv, Dk], l2-normalised, q also scaled by Dk^-0.5 (HF's
    recurrent form divides by sqrt(Dk), its chunked form multiplies: kept bit for bit)."""
    group = num_v_heads // q.shape[1]
    q = l2norm(q.float().repeat_interleave(group, dim=1))
    k = l2norm(k.float().repeat_interleave(group, dim=1))
    return (q / q.shape[-1] ** 0.5 if divide else q * q.shape[-1] ** -0.5), k


def _rows(state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    scratch = state.shape[0] - 1
    return torch.where(slots < 0, scratch, slots).long()


def recurrent_gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """One token per row b: update state[state_slots[b]] in place; out ``[B, Hv, Dv]`` in v's
    dtype."""
    rows = _rows(state, state_slots)
    qf, kf = _prepare_qk(q, k, v.shape[1], divide=True)
    s = state[rows] * (fresh == 0).float()[:, None, None, None]  # [B, Hv, Dk, Dv]
    s = s * g.float().exp()[..., None, None]
    kv_mem = (s * kf[..., None]).sum(dim=-2)  # [B, Hv, Dv]
    delta = (v.float() - kv_mem) * beta.float()[..., None]
    s = s + kf[..., None] * delta[..., None, :]
    out = (s * qf[..., None]).sum(dim=-2)
    state[rows] = s
    return out.to(v.dtype)


def chunk_gated_delta_rule_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, HF's chunked algorithm: q, k [L, Hv, Dk] prepared fp32, v [L, Hv, Dv],
    g, beta [L, Hv]; initial_state [Hv, Dk, Dv] -> (out [L, Hv, Dv] fp32, final state)."""
    length = q.shape[0]
    q, k, v, beta, g = (x.transpose(0, 1).float() for x in (q, k, v, beta, g))  # heads first
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    heads, total = q.shape[0], length + pad
    v_beta = v * beta[..., None]
    k_beta = k * beta[..., None]
    q, k, k_beta, v_beta = (
        x.reshape(heads, -1, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)
    )
    g = g.reshape(heads, -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp()[..., None]
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    s = initial_state.float()
    out = torch.zeros_like(new_values)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(total // chunk_size):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, total, -1)[:, :length].transpose(0, 1)
    return out, s


def chunk_gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    fresh: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Varlen prefill: sequence b owns tokens [cu_seqlens[b], cu_seqlens[b + 1]); its state
    row is read (zero when fresh), advanced over its tokens and written back. Out
    ``[T, Hv, Dv]`` in v's dtype."""
    qf, kf = _prepare_qk(q, k, v.shape[1])
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    cu = cu_seqlens.tolist()  # host read: prefill is never graphed
    rows = _rows(state, state_slots[: len(cu) - 1]).tolist()
    flags = fresh[: len(cu) - 1].tolist()
    for b, (row, is_fresh) in enumerate(zip(rows, flags, strict=True)):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        initial = torch.zeros_like(state[row]) if is_fresh else state[row]
        out[start:end], final = chunk_gated_delta_rule_one(
            qf[start:end], kf[start:end], v[start:end], g[start:end], beta[start:end],
            initial, chunk_size,
        )  # fmt: skip
        state[row] = final
    return out.to(v.dtype)


@triton.jit
def _gated_delta_rule_kernel(
    q_ptr,  # [T, Hk, Dk]
    k_ptr,  # [T, Hk, Dk]
    v_ptr,  # [T, Hv, Dv]
    g_ptr,  # [T, Hv] fp32
    beta_ptr,  # [T, Hv] fp32
    state_ptr,  # [num_state_slots + 1, Hv, Dk, Dv] fp32
    out_ptr,  # [T, Hv, Dv]
    cu_seqlens,  # [B + 1] int32 (VARLEN) or unused (one token per row)
    slots_ptr,  # [B] int32
    fresh_ptr,  # [B] int32
    stride_q_token,
    stride_k_token,
    stride_v_token,
    stride_out_token,
    scratch_slot,
    scale,
    NUM_V_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # Hv // Hk
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    VARLEN: tl.constexpr,
    PDL: tl.constexpr = 0,  # decode: programmatic dependent launch (atom/kernels/pdl.py)
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    if VARLEN:
        start = tl.load(cu_seqlens + seq).to(tl.int64)
        end = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    else:
        start = seq.to(tl.int64)
        end = start + 1
    slot = tl.load(slots_ptr + seq)
    slot = tl.where(slot < 0, scratch_slot, slot).to(tl.int64)
    keep = (tl.load(fresh_ptr + seq + offs_k * 0) == 0)[:, None]  # as a column: a mask
    state_ptrs = (
        state_ptr + (slot * NUM_V_HEADS + head) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    )
    state_mask = mask_k[:, None] & mask_v[None, :]
    # the state: earlier steps' (no kernel of this forward writes it before this one), so
    # under PDL it loads before the wait; q, k, v, g and beta after it
    s = tl.load(state_ptrs, mask=state_mask & keep, other=0.0)
    pdl_wait_and_release(PDL)
    k_head = head // GROUP
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_q_token + k_head * DK + offs_k, mask=mask_k, other=0.0)
        k = tl.load(k_ptr + t * stride_k_token + k_head * DK + offs_k, mask=mask_k, other=0.0)
        v = tl.load(v_ptr + t * stride_v_token + head * DV + offs_v, mask=mask_v, other=0.0)
        g = tl.load(g_ptr + t * NUM_V_HEADS + head)
        beta = tl.load(beta_ptr + t * NUM_V_HEADS + head)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        s = s * tl.exp(g)
        kv_mem = tl.sum(s * k[:, None], axis=0)
        delta = (v.to(tl.float32) - kv_mem) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(
            out_ptr + t * stride_out_token + head * DV + offs_v,
            o.to(out_ptr.dtype.element_ty),
            mask=mask_v,
        )
    nonempty = (offs_k * 0 + end > start)[:, None]  # an empty sequence keeps its state
    tl.store(state_ptrs, s, mask=state_mask & nonempty)


def _launch(q, k, v, g, beta, state, cu_seqlens, state_slots, fresh, num_rows, varlen):
    num_k_heads, dk = q.shape[1:]
    num_v_heads, dv = v.shape[1:]
    assert state.shape[1:] == (num_v_heads, dk, dv) and state.is_contiguous()
    assert state.dtype == torch.float32 and num_v_heads % num_k_heads == 0
    for x in (q, k, v):
        assert x.stride(-1) == 1 and x.stride(1) == x.shape[-1]
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_rows == 0 or v.shape[0] == 0:
        return out
    block_v = min(32, triton.next_power_of_2(dv))
    grid = (num_rows, num_v_heads, triton.cdiv(dv, block_v))
    pdl, launch = (0, {}) if varlen else pdl_chain_launch(v)  # decode's chain only
    _gated_delta_rule_kernel[grid](
        q, k, v, g, beta, state, out, cu_seqlens if varlen else state_slots, state_slots, fresh,
        q.stride(0), k.stride(0), v.stride(0), out.stride(0), state.shape[0] - 1, dk**-0.5,
        NUM_V_HEADS=num_v_heads, GROUP=num_v_heads // num_k_heads, DK=dk, DV=dv,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, VARLEN=varlen, PDL=pdl, **launch,
    )  # fmt: skip
    return out


def recurrent_gated_delta_rule(q, k, v, g, beta, state, state_slots, fresh) -> torch.Tensor:
    """`recurrent_gated_delta_rule_reference` on the Triton kernel (CUDA-graph capturable)."""
    if not use_triton(v):
        return recurrent_gated_delta_rule_reference(q, k, v, g, beta, state, state_slots, fresh)
    return _launch(q, k, v, g, beta, state, None, state_slots, fresh, v.shape[0], False)


def chunk_gated_delta_rule(q, k, v, g, beta, state, cu_seqlens, state_slots, fresh):
    """The varlen prefill of `chunk_gated_delta_rule_reference` on the Triton kernel (its
    recurrent form; no host read)."""
    if not use_triton(v):
        return chunk_gated_delta_rule_reference(
            q, k, v, g, beta, state, cu_seqlens, state_slots, fresh
        )
    num_seqs = cu_seqlens.shape[0] - 1
    return _launch(q, k, v, g, beta, state, cu_seqlens, state_slots, fresh, num_seqs, True)

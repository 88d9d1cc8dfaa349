"""The chunked (UT-transform) gated delta rule for varlen prefill, in Triton.

The math and the torch reference are `chunk_gated_delta_rule_reference` in
atom/kernels/gdn_delta_rule.py (HF transformers' `torch_chunk_gated_delta_rule` per
sequence); this file runs the same algorithm on the GPU in two kernels:

1. `_chunk_inverse_kernel`, one program per (chunk, value head), all chunks of all sequences
   at once: for the chunk's rows i, j (``CHUNK`` = 64 tokens, the last chunk of a sequence
   shorter), with k l2-normalised and cum the in-chunk cumulative sum of g,
   ``N[i, j] = beta_i (k_i . k_j) exp(cum_i - cum_j)`` for i > j, and
   ``inverse = (I + N)^-1`` in fp32 (forward substitution inside the 16 x 16 diagonal
   blocks, then block substitution by dots). Stored per token: ``[T, Hv, CHUNK]`` fp32
   (row i of a chunk at the chunk's i-th token).
2. `_chunk_state_kernel`, one program per (sequence, value head, block of Dv), walking the
   sequence's chunks in order with its ``[Dk, BLOCK_V]`` state slice in registers:
   ``w = inverse @ (beta k exp(cum))``, ``u = inverse @ (beta v)``, ``v_new = u - w @ S``,
   ``o = (q exp(cum)) @ S + (causal(q k^T) exp(cum_i - cum_j)) @ v_new``,
   ``S <- S exp(cum_last) + (k exp(cum_last - cum))^T @ v_new``.

Chunks start at each sequence's first token (cu_seqlens), so a sequence of any length, at
any start position (its state row continues; zero when ``fresh``), gives the reference's
chunks exactly. No runtime length is a scalar argument: chunk bounds are computed on the
device from ``cu_seqlens`` (no host read), rows come from the grid. Geometry (constexpr):
heads, head dims, tiles, the dots' precision. Inputs bf16 or fp32, everything computed in
fp32; the state is fp32. The dots' precision (`DOT_PRECISION`): "ieee" for fp32 inputs (TF32,
a GPU's default, would make a greedy fp32 run drift from the reference), "tf32x3" (fp32-like,
on tensor cores) for bf16 inputs; benchmarks/gdn_prefill.py measures all three.

`chunked_gated_delta_rule` is worth it for long prefills; for short ones the sequential
kernel (`chunk_gated_delta_rule`, the recurrent form) has less work: the GDN backend picks by
the longest new run, `CHUNKED_MIN_TOKENS`.
"""

from __future__ import annotations

import torch

from atom.kernels.gdn_delta_rule import chunk_gated_delta_rule_reference
from atom.kernels.platform import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)

CHUNK = 64
# The GDN backend's choice on CUDA (`use_chunked`): the chunked kernels for a step of at most
# CHUNKED_MAX_SEQS sequences whose longest new run reaches CHUNKED_MIN_TOKENS, the
# sequential kernel otherwise: the chunked kernels win only on one long run, the sequential
# kernel's grid fills the GPU once there are several sequences (`python -m
# benchmarks.gdn_prefill`, figures in docs/benchmarks.md).
# The length is `Fusions.gdn_chunked_min_tokens` (ATOM_GDN_CHUNKED_MIN_TOKENS, default
# 8192; a huge value: never chunked).
CHUNKED_MAX_SEQS = 1


def use_chunked(max_seqlen: int, num_seqs: int, min_tokens: int) -> bool:
    """Whether a CUDA prefill step takes the chunked kernels: at most CHUNKED_MAX_SEQS
    sequences whose longest new run reaches `min_tokens`."""
    return max_seqlen >= min_tokens and num_seqs <= CHUNKED_MAX_SEQS


# Of every dot (fp32 operands): "ieee" is exact fp32 (fp32 inputs: greedy runs match the
# reference); "tf32x3" about as exact on tensor cores (bf16 inputs, whose own rounding is
# far coarser); "tf32" (10-bit mantissas) is what a GPU would do unasked.
DOT_PRECISION = {torch.float32: "ieee", torch.bfloat16: "tf32x3", torch.float16: "tf32x3"}


@triton.jit
def _chunk_inverse_kernel(
    k_ptr,  # [T, Hk, Dk]
    g_ptr,  # [T, Hv] fp32
    beta_ptr,  # [T, Hv] fp32
    inverse_ptr,  # [T, Hv, CHUNK] fp32 (out)
    bounds_ptr,  # [max_chunks, 3] int32 (chunk_bounds): first token, end, sequence
    stride_k_token,
    NUM_V_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # Hv // Hk
    DK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,  # diagonal blocks inverted by substitution; CHUNK // SUB must be 4
    DOT_PRECISION: tl.constexpr,  # "ieee", "tf32x3" (fp32-like on tensor cores) or "tf32"
):
    chunk = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    first = tl.load(bounds_ptr + chunk * 3).to(tl.int64)
    end = tl.load(bounds_ptr + chunk * 3 + 1).to(tl.int64)
    if end <= first:  # the grid is sized for the most chunks T tokens can make
        return
    offs_t = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    tokens = first + offs_t
    mask_t = tokens < end
    k_ptrs = k_ptr + tokens[:, None] * stride_k_token + (head // GROUP) * DK + offs_k[None, :]
    k = tl.load(k_ptrs, mask=mask_t[:, None] & (offs_k < DK)[None, :], other=0.0)
    k = k.to(tl.float32)
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    g = tl.load(g_ptr + tokens * NUM_V_HEADS + head, mask=mask_t, other=0.0)
    beta = tl.load(beta_ptr + tokens * NUM_V_HEADS + head, mask=mask_t, other=0.0)
    cum = tl.cumsum(g, axis=0)
    lower = offs_t[:, None] > offs_t[None, :]
    decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0))
    kk = tl.dot(k * beta[:, None], tl.trans(k), input_precision=DOT_PRECISION)  # [CHUNK, CHUNK]
    n = tl.where(lower, kk * decay, 0.0)  # I + n: the unit lower-triangular system
    # 1) the diagonal SUB x SUB blocks' inverses d = (I + n_diag)^-1 by forward substitution,
    #    the same row of every block at once: y = d - I, row r = a_r + a_r @ y with
    #    a_r = -n[r, :] (rows below r still hold -n, which a_r, zero from column r on,
    #    never reaches).
    identity = (offs_t[:, None] == offs_t[None, :]).to(tl.float32)
    same_block = offs_t[:, None] // SUB == offs_t[None, :] // SUB
    y = tl.where(same_block, -n, 0.0)
    for i in range(1, SUB):
        a = tl.where((offs_t % SUB == i)[:, None], y, 0.0)
        y = tl.where(
            (offs_t % SUB == i)[:, None], a + tl.dot(a, y, input_precision=DOT_PRECISION), y
        )
    d = y + identity
    # 2) (I + n)^-1 = (I + m)^-1 d with m = d @ n_below (strictly block-lower: m^4 = 0 for
    #    CHUNK / SUB = 4 blocks), so (I + m)^-1 = (I - m)(I + m^2): block forward substitution.
    m = tl.dot(d, tl.where(same_block, 0.0, n), input_precision=DOT_PRECISION)
    m2 = tl.dot(m, m, input_precision=DOT_PRECISION)
    p = identity - m + m2 - tl.dot(m, m2, input_precision=DOT_PRECISION)
    inverse = tl.dot(p, d, input_precision=DOT_PRECISION)
    out_ptrs = inverse_ptr + (tokens[:, None] * NUM_V_HEADS + head) * CHUNK + offs_t[None, :]
    tl.store(out_ptrs, inverse, mask=mask_t[:, None])


@triton.jit
def _chunk_state_kernel(
    q_ptr,  # [T, Hk, Dk]
    k_ptr,  # [T, Hk, Dk]
    v_ptr,  # [T, Hv, Dv]
    g_ptr,  # [T, Hv] fp32
    beta_ptr,  # [T, Hv] fp32
    inverse_ptr,  # [T, Hv, CHUNK] fp32, from _chunk_inverse_kernel
    state_ptr,  # [num_state_slots + 1, Hv, Dk, Dv] fp32
    out_ptr,  # [T, Hv, Dv]
    cu_seqlens,  # [B + 1] int32
    slots_ptr,  # [B] int32
    fresh_ptr,  # [B] int32
    stride_q_token,
    stride_k_token,
    stride_v_token,
    stride_out_token,
    scratch_slot,
    scale,
    NUM_V_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_t = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    start = tl.load(cu_seqlens + seq).to(tl.int64)
    end = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq)
    slot = tl.where(slot < 0, scratch_slot, slot).to(tl.int64)
    keep = (tl.load(fresh_ptr + seq + offs_k * 0) == 0)[:, None]  # as a column: a mask
    state_ptrs = (
        state_ptr + (slot * NUM_V_HEADS + head) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    )
    state_mask = mask_k[:, None] & mask_v[None, :]
    s = tl.load(state_ptrs, mask=state_mask & keep, other=0.0)
    k_head = head // GROUP
    causal = offs_t[:, None] >= offs_t[None, :]
    for first in range(start, end, CHUNK):
        tokens = first + offs_t
        mask_t = tokens < end
        qk_mask = mask_t[:, None] & mask_k[None, :]
        q = tl.load(
            q_ptr + tokens[:, None] * stride_q_token + k_head * DK + offs_k[None, :],
            mask=qk_mask,
            other=0.0,
        ).to(tl.float32)
        k = tl.load(
            k_ptr + tokens[:, None] * stride_k_token + k_head * DK + offs_k[None, :],
            mask=qk_mask,
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            v_ptr + tokens[:, None] * stride_v_token + head * DV + offs_v[None, :],
            mask=mask_t[:, None] & mask_v[None, :],
            other=0.0,
        ).to(tl.float32)
        g = tl.load(g_ptr + tokens * NUM_V_HEADS + head, mask=mask_t, other=0.0)
        beta = tl.load(beta_ptr + tokens * NUM_V_HEADS + head, mask=mask_t, other=0.0)
        inverse = tl.load(
            inverse_ptr + (tokens[:, None] * NUM_V_HEADS + head) * CHUNK + offs_t[None, :],
            mask=mask_t[:, None],
            other=0.0,
        )
        q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * scale)[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        cum = tl.cumsum(g, axis=0)  # padded rows add 0: the last row is the chunk's total
        last = tl.sum(tl.where(offs_t == CHUNK - 1, cum, 0.0), axis=0)
        w = tl.dot(inverse, k * (beta * tl.exp(cum))[:, None], input_precision=DOT_PRECISION)
        u = tl.dot(inverse, v * beta[:, None], input_precision=DOT_PRECISION)
        v_new = u - tl.dot(w, s, input_precision=DOT_PRECISION)  # [CHUNK, BLOCK_V]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        qk = tl.where(causal, qk * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
        o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=DOT_PRECISION)
        o += tl.dot(qk, v_new, input_precision=DOT_PRECISION)
        tl.store(
            out_ptr + tokens[:, None] * stride_out_token + head * DV + offs_v[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=mask_t[:, None] & mask_v[None, :],
        )
        k_decayed = k * tl.exp(last - cum)[:, None]
        s = s * tl.exp(last) + tl.dot(tl.trans(k_decayed), v_new, input_precision=DOT_PRECISION)
    nonempty = (offs_k * 0 + end > start)[:, None]  # an empty sequence keeps its state
    tl.store(state_ptrs, s, mask=state_mask & nonempty)


def chunk_bounds(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[cdiv(T, CHUNK) + B, 3]`` int32 on cu_seqlens' device, without a host read: per
    chunk its first token, its end and its sequence, each sequence's chunks in order (CHUNK
    tokens from the sequence's start, the last one shorter), then unused rows (first = end =
    0). Shared by the chunked delta rule and the conv prefill (atom/kernels/gdn_conv.py)."""
    num_seqs = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.long()
    counts = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    ends = counts.cumsum(0)  # chunk index after each sequence's last chunk
    ids = torch.arange(triton.cdiv(num_tokens, CHUNK) + num_seqs, device=cu.device)
    seq = torch.searchsorted(ends, ids, right=True).clamp_(max=num_seqs - 1)
    first = cu[seq] + (ids - ends[seq] + counts[seq]) * CHUNK
    last = torch.minimum(first + CHUNK, cu[seq + 1])
    used = ids < ends[-1]
    zero = torch.zeros_like(first)
    return torch.stack([first.where(used, zero), last.where(used, zero), seq], dim=1).int()


def chunked_gated_delta_rule(
    q, k, v, g, beta, state, cu_seqlens, state_slots, fresh, bounds=None, precision=None,
    block_v=32, num_warps=None,
) -> torch.Tensor:  # fmt: skip
    """`chunk_gated_delta_rule_reference` (same arguments, same result) on the chunked
    Triton kernels. ``precision`` of every dot: "ieee" (exact fp32 products), "tf32x3"
    (about as exact, on tensor cores) or "tf32"; default `DOT_PRECISION` of v's dtype.
    ``bounds``: `chunk_bounds(cu_seqlens, T)` if the caller has it. ``block_v`` /
    ``num_warps``: the state pass's tile (default warps: 8 from
    head dims of 128 on, whose [64, Dk] fp32 tiles would spill at 4)."""
    if not use_triton(v):
        return chunk_gated_delta_rule_reference(
            q, k, v, g, beta, state, cu_seqlens, state_slots, fresh
        )
    num_k_heads, dk = q.shape[1:]
    num_v_heads, dv = v.shape[1:]
    assert state.shape[1:] == (num_v_heads, dk, dv) and state.is_contiguous()
    assert state.dtype == torch.float32 and num_v_heads % num_k_heads == 0
    precision = precision or DOT_PRECISION[v.dtype]
    assert precision in ("ieee", "tf32x3", "tf32")
    for x in (q, k, v):
        assert x.stride(-1) == 1 and x.stride(1) == x.shape[-1]
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    num_tokens, num_seqs = v.shape[0], cu_seqlens.shape[0] - 1
    if num_seqs == 0 or num_tokens == 0:
        return out
    block_k = max(16, triton.next_power_of_2(dk))  # tl.dot needs 16 or more
    block_v = max(16, min(block_v, triton.next_power_of_2(dv)))
    wide = 8 if block_k >= 128 else 4
    bounds = chunk_bounds(cu_seqlens, num_tokens) if bounds is None else bounds
    inverse = torch.empty(num_tokens, num_v_heads, CHUNK, dtype=torch.float32, device=v.device)
    geometry = dict(NUM_V_HEADS=num_v_heads, GROUP=num_v_heads // num_k_heads, DK=dk)
    _chunk_inverse_kernel[(bounds.shape[0], num_v_heads)](
        k, g, beta, inverse, bounds, k.stride(0), **geometry, BLOCK_K=block_k, CHUNK=CHUNK,
        SUB=CHUNK // 4, DOT_PRECISION=precision, num_warps=wide,
    )  # fmt: skip
    grid = (num_seqs, num_v_heads, triton.cdiv(dv, block_v))
    _chunk_state_kernel[grid](
        q, k, v, g, beta, inverse, state, out, cu_seqlens, state_slots, fresh,
        q.stride(0), k.stride(0), v.stride(0), out.stride(0), state.shape[0] - 1, dk**-0.5,
        **geometry, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, CHUNK=CHUNK,
        DOT_PRECISION=precision, num_warps=num_warps or wide,
        num_stages=1,  # pipelined chunk loads overflow a Hopper SM's 227 KiB of shared memory
    )  # fmt: skip
    return out

"""A candidate that lost to its torch reference: DeepSeek-V4.1's Engram lookup in Triton
(atom/kernels/v41_engram.py `engram_reference` is what the engine runs).

Two kernels: a gathered GEMM (the A operand is loaded straight from the table rows the hash
ids name: no gathered copy; fp32 accumulation and fp32 key/value out) and one program per
(16 tokens, stream) for the norms, the gate and the add. Runtime length: num_tokens
(do_not_specialize); geometry constexpr. Offsets int64. Measured by
`python -m benchmarks.deepseek_v41_kernels`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.platform import use_triton
from atom.kernels.v41_engram import engram_reference


@triton.jit(do_not_specialize=["num_tokens"])
def _engram_kv_kernel(
    hash_ids_ptr,  # [T, COLS] int64 (row stride stride_hash_row)
    table_ptr,  # [rows, HEAD_DIM]
    wkv_ptr,  # [WIDTH, COLS * HEAD_DIM]
    kv_ptr,  # [T, WIDTH] fp32
    num_tokens,
    stride_hash_row,
    COLS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    w = tl.program_id(1).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    t_mask, w_mask = t < num_tokens, w < WIDTH
    depth: tl.constexpr = COLS * HEAD_DIM
    acc = tl.zeros([BLOCK_T, BLOCK_W], tl.float32)
    for start in range(0, depth, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        k_mask = kk < depth
        col, channel = kk // HEAD_DIM, kk % HEAD_DIM
        mask = t_mask[:, None] & k_mask[None, :]
        ids = tl.load(hash_ids_ptr + t[:, None] * stride_hash_row + col[None, :], mask=mask,
                      other=0)  # fmt: skip
        a = tl.load(table_ptr + ids * HEAD_DIM + channel[None, :], mask=mask, other=0.0)
        b = tl.load(wkv_ptr + w[:, None] * depth + kk[None, :],
                    mask=w_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        acc += tl.dot(a.to(b.dtype), tl.trans(b), input_precision="ieee")
    tl.store(kv_ptr + t[:, None] * WIDTH + w[None, :], acc,
             mask=t_mask[:, None] & w_mask[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["num_tokens"])
def _engram_gate_kernel(
    streams_ptr,  # [T, HC, DIM] (token stride stride_streams_row, stream stride DIM)
    kv_ptr,  # [T, (HC + 1) * DIM] fp32: HC keys, then the value
    weight_ptr,  # [HC, DIM] fp32: q_weight * k_weight
    out_ptr,  # [T, HC, DIM] contiguous
    num_tokens,
    stride_streams_row,
    eps,
    scale,  # DIM^-0.5
    HC: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (BLOCK_T tokens, stream): two passes over DIM (sums, then the add)."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    stream = tl.program_id(1)
    t_mask = tokens < num_tokens
    offs = tl.arange(0, BLOCK_D)
    h_rows = streams_ptr + tokens[:, None] * stride_streams_row + stream * DIM
    kv_rows = kv_ptr + tokens[:, None] * ((HC + 1) * DIM)
    h_sq = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    k_sq = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    dot = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for start in range(0, DIM, BLOCK_D):
        d = start + offs
        mask = t_mask[:, None] & (d < DIM)[None, :]
        h = tl.load(h_rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
        key = tl.load(kv_rows + stream * DIM + d[None, :], mask=mask, other=0.0)
        weight = tl.load(weight_ptr + stream * DIM + d, mask=d < DIM, other=0.0)
        h_sq += h * h
        k_sq += key * key
        dot += h * weight[None, :] * key
    rstd = tl.rsqrt(tl.sum(h_sq, axis=1) / DIM + eps) * tl.rsqrt(tl.sum(k_sq, axis=1) / DIM + eps)
    gate_logit = tl.sum(dot, axis=1) * rstd * scale
    root = tl.sqrt(tl.maximum(tl.abs(gate_logit), 1e-6))
    gate = tl.sigmoid(tl.where(gate_logit < 0, -root, root))
    out_rows = out_ptr + (tokens[:, None] * HC + stream) * DIM
    for start in range(0, DIM, BLOCK_D):
        d = start + offs
        mask = t_mask[:, None] & (d < DIM)[None, :]
        h = tl.load(h_rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
        value = tl.load(kv_rows + HC * DIM + d[None, :], mask=mask, other=0.0)
        out = h + gate[:, None] * value
        tl.store(out_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def engram(streams, hash_ids, table, wkv, q_weight, k_weight, eps: float) -> torch.Tensor:
    """Triton `engram_reference` (same arguments; key and value stay fp32 between the
    kernels, where the reference rounds them to the weights' dtype)."""
    if not use_triton(streams):
        return engram_reference(streams, hash_ids, table, wkv, q_weight, k_weight, eps)
    num_tokens, hc, dim = streams.shape
    cols, head_dim = hash_ids.shape[1], table.shape[1]
    width = wkv.shape[0]
    assert width == (hc + 1) * dim and wkv.shape[1] == cols * head_dim
    if streams.stride(2) != 1 or streams.stride(1) != dim:
        streams = streams.contiguous()
    if hash_ids.stride(1) != 1:  # a row stride is fine (one layer's columns of all layers')
        hash_ids = hash_ids.contiguous()
    table, wkv = table.contiguous(), wkv.contiguous()
    out = torch.empty(num_tokens, hc, dim, dtype=streams.dtype, device=streams.device)
    if num_tokens == 0:
        return out
    kv = torch.empty(num_tokens, width, dtype=torch.float32, device=streams.device)
    block_t, block_w, block_k = 16, 64, 32
    _engram_kv_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(width, block_w))](
        hash_ids, table, wkv, kv, num_tokens, hash_ids.stride(0),
        COLS=cols, HEAD_DIM=head_dim, WIDTH=width, BLOCK_T=block_t, BLOCK_W=block_w,
        BLOCK_K=block_k,
    )  # fmt: skip
    weight = (q_weight.float() * k_weight.float()).contiguous()
    _engram_gate_kernel[(triton.cdiv(num_tokens, block_t), hc)](
        streams, kv, weight, out, num_tokens, streams.stride(0), eps, dim**-0.5,
        HC=hc, DIM=dim, BLOCK_T=block_t, BLOCK_D=min(256, triton.next_power_of_2(dim)),
    )  # fmt: skip
    return out

"""Multi-head latent attention (MLA) kernels: the latent KV write and paged decode.

The MLA cache holds one row per token and layer, shared by every head:
    latent_cache   [num_blocks, block_size, kv_lora_rank + rope_dim], contiguous; the row of
                   a token is (normalised compressed KV c | rotated rope key k_pe).

Latent write (`store_latent_cache`):
    latent         [num_tokens, kv_lora_rank + rope_dim], the cache's dtype; rows may be
                   strided (unit stride inside a row).
    slot_mapping   [num_tokens] int32/int64; slot = block_id * block_size + offset, -1 skips.
Runtime length: num_tokens (do_not_specialize). One program writes BLOCK_T whole rows.

Paged decode with absorbed weights (`paged_mla_decode`): the query is already in latent
space (q_nope @ W_UK per head), so every head attends over the same cached rows:
    q_latent       [batch, num_heads, kv_lora_rank]
    q_rope         [batch, num_heads, rope_dim]
    block_tables   [batch_capacity >= batch, max_blocks_per_seq] int32 (page-table rows)
    context_lens   [batch] int32, 0 = padding row (output zeros)
    out            [batch, num_heads, kv_lora_rank]: softmax(scale * (q_latent . c +
                   q_rope . k_pe)) @ c, still in latent space (the caller applies W_UV).
Runtime lengths: batch (grid) and context_lens (device memory), the block-table row
stride (page-table width, do_not_specialize). Geometry (constexpr): ranks, heads tile,
block size. One program per (sequence, head block): it walks the sequence's cache blocks
through its page-table row, one block (BLOCK_SIZE tokens) per iteration, with an online
softmax in fp32. Cache offsets are int64 (num_blocks * block_size * 576 passes 2^31).
"""

import torch

from atom.kernels.platform import dot_precision, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


# -- latent KV write ---------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_tokens"])
def _store_latent_kernel(
    latent_ptr,
    cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_latent_token,
    LATENT_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_D: tl.constexpr,  # next_power_of_2(LATENT_DIM)
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    mask = (slot >= 0)[:, None] & (offs_d < LATENT_DIM)[None, :]
    rows = latent_ptr + tokens.to(tl.int64)[:, None] * stride_latent_token + offs_d[None, :]
    values = tl.load(rows, mask=mask, other=0.0)
    tl.store(cache_ptr + slot[:, None] * LATENT_DIM + offs_d[None, :], values, mask=mask)


def store_latent_cache(
    latent: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``latent`` rows into ``latent_cache`` at ``slot_mapping`` (-1 skips), in place."""
    if not use_triton(latent):
        store_latent_cache_reference(latent, latent_cache, slot_mapping)
        return
    num_tokens, latent_dim = latent.shape
    assert latent.stride(1) == 1 and latent_cache.is_contiguous()
    assert latent_cache.shape[2] == latent_dim and latent_cache.dtype == latent.dtype
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(latent_dim)
    block_t = max(1, 4096 // block_d)
    _store_latent_kernel[(triton.cdiv(num_tokens, block_t),)](
        latent,
        latent_cache,
        slot_mapping,
        num_tokens,
        latent.stride(0),
        LATENT_DIM=latent_dim,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=4,
    )


def store_latent_cache_reference(
    latent: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    keep = slot_mapping[: latent.shape[0]] >= 0
    flat[slot_mapping[: latent.shape[0]][keep].long()] = latent[keep].to(flat.dtype)


# -- paged decode ------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_block_tables_row"])
def _paged_mla_decode_kernel(
    q_latent_ptr,
    q_rope_ptr,
    cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    sm_scale,
    stride_q_latent_batch,
    stride_q_latent_head,
    stride_q_rope_batch,
    stride_q_rope_head,
    stride_cache_block,
    stride_block_tables_row,
    stride_out_batch,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program, a power of 2 >= 16 for tl.dot
    BLOCK_L: tl.constexpr,  # next_power_of_2(KV_LORA_RANK)
    BLOCK_R: tl.constexpr,  # next_power_of_2(ROPE_DIM), >= 16
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block = tokens per iteration
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else a GPU rounds them to TF32
):
    batch_idx = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_SIZE)
    h_mask = heads < NUM_HEADS
    l_mask = offs_l < KV_LORA_RANK
    r_mask = offs_r < ROPE_DIM

    q_latent = tl.load(
        q_latent_ptr
        + batch_idx * stride_q_latent_batch
        + heads[:, None] * stride_q_latent_head
        + offs_l[None, :],
        mask=h_mask[:, None] & l_mask[None, :],
        other=0.0,
    )
    q_rope = tl.load(
        q_rope_ptr
        + batch_idx * stride_q_rope_batch
        + heads[:, None] * stride_q_rope_head
        + offs_r[None, :],
        mask=h_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    dtype = q_latent_ptr.dtype.element_ty

    context_len = tl.load(context_lens_ptr + batch_idx)
    # Finite initial max: a fully masked tile then gives exp2(-inf) = 0, never NaN.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # softmax via exp2

    block_table_row = block_tables_ptr + batch_idx * stride_block_tables_row
    for block_start in range(0, context_len, BLOCK_SIZE):
        pos = block_start + offs_n
        n_mask = pos < context_len
        block_id = tl.load(block_table_row + block_start // BLOCK_SIZE).to(tl.int64)
        rows = (
            cache_ptr
            + block_id * stride_cache_block
            + offs_n.to(tl.int64) * (KV_LORA_RANK + ROPE_DIM)
        )
        latent = tl.load(
            rows[:, None] + offs_l[None, :], mask=n_mask[:, None] & l_mask[None, :], other=0.0
        )
        k_rope = tl.load(
            rows[:, None] + KV_LORA_RANK + offs_r[None, :],
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        qk = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)
        qk += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
        qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), latent, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no tokens (padding row): zeros
    acc = acc / l_safe[:, None]
    out_ptrs = (
        out_ptr + batch_idx * stride_out_batch + heads[:, None] * stride_out_head + offs_l[None, :]
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & l_mask[None, :])


def paged_mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention in latent space: [batch, heads, kv_lora_rank] (see module doc)."""
    if not use_triton(q_latent):
        return paged_mla_decode_reference(
            q_latent, q_rope, latent_cache, block_tables, context_lens, scale
        )
    batch, num_heads, kv_lora_rank = q_latent.shape
    rope_dim = q_rope.shape[2]
    _, block_size, latent_dim = latent_cache.shape
    assert latent_dim == kv_lora_rank + rope_dim and latent_cache.is_contiguous()
    assert q_latent.stride(2) == 1 and q_rope.stride(2) == 1
    assert q_latent.dtype == q_rope.dtype == latent_cache.dtype
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "tl.dot needs >= 16 tokens"
    out = torch.empty_like(q_latent)
    if batch == 0:
        return out
    block_h = max(16, min(64, triton.next_power_of_2(num_heads)))
    grid = (batch, triton.cdiv(num_heads, block_h))
    _paged_mla_decode_kernel[grid](
        q_latent,
        q_rope,
        latent_cache,
        block_tables,
        context_lens,
        out,
        scale,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        latent_cache.stride(0),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        KV_LORA_RANK=kv_lora_rank,
        ROPE_DIM=rope_dim,
        BLOCK_H=block_h,
        BLOCK_L=triton.next_power_of_2(kv_lora_rank),
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)),
        BLOCK_SIZE=block_size,
        DOT_PRECISION=dot_precision(q_latent.dtype),
        num_warps=4 if kv_lora_rank <= 128 else 8,
    )
    return out


def paged_mla_decode_reference(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same math in torch, fp32 softmax; graph-safe (no host reads of the lengths)."""
    batch, _, kv_lora_rank = q_latent.shape
    _, block_size, latent_dim = latent_cache.shape
    tables = block_tables[:batch].long()
    rows = latent_cache[tables].reshape(batch, -1, latent_dim).float()  # [B, W * bs, D]
    positions = torch.arange(rows.shape[1], device=rows.device)
    valid = positions[None, :] < context_lens[:batch, None].long()  # [B, N]
    rows = rows.masked_fill(~valid[..., None], 0.0)  # never-written rows may hold NaN
    latent, k_rope = rows[..., :kv_lora_rank], rows[..., kv_lora_rank:]
    scores = torch.einsum("bhl,bnl->bhn", q_latent.float(), latent)
    scores = scores + torch.einsum("bhr,bnr->bhn", q_rope.float(), k_rope)
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padding rows: all masked
    out = torch.einsum("bhn,bnl->bhl", weights, latent)
    return out.to(q_latent.dtype)

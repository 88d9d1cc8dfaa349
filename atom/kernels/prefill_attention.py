"""Causal varlen attention over the paged KV cache for prefill, chunked prefill and mixed steps.

The keys and values of every token (cached prefix and this step's new tokens) are already
in the cache. The new tokens of sequence b are its last q_len = cu_seqlens_q[b + 1] -
cu_seqlens_q[b] positions: query i sits at absolute position context_len - q_len + i and
attends to KV positions 0..that position. A row with q_len == 1 is a decode row.

Shapes and dtypes:
    q              [total_q_tokens, num_q_heads, head_dim], fp16/bf16/fp32
    k_cache,
    v_cache        [num_blocks, block_size, num_kv_heads, head_dim], contiguous; q's dtype,
                   or torch.float8_e4m3fn with k_scale / v_scale
    k_scale,
    v_scale        [num_blocks, block_size, num_kv_heads] float32 (fp8 cache only): a cached
                   row is q_fp8 * scale (see atom/kernels/kv_cache.py)
    block_tables   [batch_capacity >= batch, max_blocks_per_seq], int32
    cu_seqlens_q   [batch + 1], int32: query start offsets into q
    context_lens   [batch], int32: KV length of each sequence after this step
    out            [total_q_tokens, num_q_heads, head_dim], q's dtype

GQA: query head h reads kv head h // (num_q_heads // num_kv_heads).

Runtime lengths: batch, total_q_tokens, cu_seqlens_q, context_lens (read on the device),
max_seqlen_q (a host int that only sizes the grid) and the block-table row stride (the
page-table width, in do_not_specialize). Geometry (constexpr): head_dim, block_size, group
size, tile sizes, whether the cache is fp8.

Kernel design (FlashAttention-2 forward, as in Triton's fused-attention tutorial): grid
(cdiv(max_seqlen_q, BLOCK_M), batch, num_q_heads). A program takes BLOCK_M queries of one
sequence and one head, walks KV positions 0..its last query position in tiles of BLOCK_N
tokens gathered through the block table, and keeps an online softmax in fp32. An fp8 cache
is dequantized as in the decode kernel: K and V widened to q's dtype (exact), k_scale applied
to the score columns, v_scale to the softmax weights before P @ V.
"""

import torch

from atom.kernels.decode_attention import check_kv_scales, gather_kv_reference
from atom.kernels.platform import dot_precision, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


@triton.jit(do_not_specialize=["stride_block_tables_row"])
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    out_ptr,
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp32, used when KV_FP8
    v_scale_ptr,
    sm_scale,
    stride_q_token,
    stride_q_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_scale_block,
    stride_scale_offset,
    stride_block_tables_row,
    stride_out_token,
    stride_out_head,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # KV tokens per tile
    KV_FP8: tl.constexpr,  # e4m3 cache with per-(token, head) scales
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else a GPU rounds them to TF32
):
    m_block = tl.program_id(0)
    batch_idx = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    kv_head = head // GROUP_SIZE

    q_start = tl.load(cu_seqlens_q_ptr + batch_idx)
    q_len = tl.load(cu_seqlens_q_ptr + batch_idx + 1) - q_start
    if m_block * BLOCK_M >= q_len:  # the grid is sized for the longest sequence
        return
    context_len = tl.load(context_lens_ptr + batch_idx)
    prefix_len = context_len - q_len  # KV already cached before this step

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix_len + offs_m  # absolute position of each query

    token = (q_start + offs_m).to(tl.int64)
    q_ptrs = q_ptr + token[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    dtype = q_ptr.dtype.element_ty  # of the dots: an fp8 cache is widened to it exactly

    # Finite initial max: a fully masked row then gives exp2(-inf) = 0, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # softmax via exp2

    # Causal: nothing past this block's last query position is needed.
    end = tl.minimum(context_len, prefix_len + (m_block + 1) * BLOCK_M)
    block_table_row = block_tables_ptr + batch_idx * stride_block_tables_row
    for tile_start in range(0, end, BLOCK_N):
        pos = tile_start + offs_n
        n_mask = pos < end
        # token -> (block id from the table, offset inside the block); int64 past 2^31.
        block_id = tl.load(block_table_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        token_offs = (
            block_id * stride_cache_block
            + (pos % BLOCK_SIZE) * stride_cache_offset
            + kv_head * stride_cache_head
        )
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + token_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + token_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)

        qk = tl.dot(q, tl.trans(k.to(dtype)), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if KV_FP8:
            scale_offs = block_id * stride_scale_block + (pos % BLOCK_SIZE) * stride_scale_offset
            k_scale = tl.load(k_scale_ptr + scale_offs + kv_head, mask=n_mask, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_offs + kv_head, mask=n_mask, other=0.0)
            qk = qk * k_scale[None, :]
        causal = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        qk = tl.where(causal, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v.to(dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_ptrs = (
        out_ptr + token[:, None] * stride_out_token + head * stride_out_head + offs_d[None, :]
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged KV; returns ``out``.

    ``max_seqlen_q`` (host int, >= every q_len) only sizes the grid. An fp8 cache needs
    ``k_scale`` and ``v_scale``. Runs the Triton kernel on CUDA (or under
    TRITON_INTERPRET=1), the torch reference otherwise.
    """
    if not use_triton(q):
        return paged_prefill_attention_reference(
            q,
            k_cache,
            v_cache,
            block_tables,
            cu_seqlens_q,
            context_lens,
            scale,
            max_seqlen_q,
            out,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    total_q_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = cu_seqlens_q.shape[0] - 1
    assert num_q_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.shape[0] >= batch and context_lens.shape[0] >= batch
    kv_fp8, k_scale, v_scale = check_kv_scales(k_cache, v_cache, k_scale, v_scale, q.dtype)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0 or total_q_tokens == 0 or max_seqlen_q == 0:
        return out
    # 64x64 tiles on a GPU; bigger ones in the interpreter, which pays per program.
    block_m, block_n = (64, 64) if q.is_cuda else (128, 256)
    grid = (triton.cdiv(max_seqlen_q, block_m), batch, num_q_heads)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        k_scale,
        v_scale,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scale.stride(0) if kv_fp8 else 0,
        k_scale.stride(1) if kv_fp8 else 0,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP_SIZE=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        KV_FP8=kv_fp8,
        DOT_PRECISION=dot_precision(q.dtype),
    )
    return out


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch ``paged_prefill_attention``: gathers each sequence's blocks, fp32 math.

    Queries go in chunks so the score matrix stays around 2^25 elements on long prompts.
    ``max_seqlen_q`` is accepted for signature parity and unused.
    """
    total_q_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_q_heads // num_kv_heads
    result = torch.zeros(
        total_q_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device
    )
    cu_seqlens = cu_seqlens_q.tolist()
    for b, context_len in enumerate(context_lens[: len(cu_seqlens) - 1].tolist()):
        q_start, q_end = cu_seqlens[b], cu_seqlens[b + 1]
        q_len = q_end - q_start
        if q_len == 0 or context_len == 0:
            continue
        prefix_len = context_len - q_len
        blocks = block_tables[b, : (context_len + block_size - 1) // block_size].long()
        # [kv_heads, 1, context, dim]: broadcasts over the query-head group.
        k = gather_kv_reference(k_cache, k_scale, blocks, context_len).permute(1, 0, 2).unsqueeze(1)
        v = gather_kv_reference(v_cache, v_scale, blocks, context_len).permute(1, 0, 2).unsqueeze(1)
        chunk = max(1, 2**25 // (context_len * num_q_heads))
        for lo in range(0, q_len, chunk):
            hi = min(lo + chunk, q_len)
            kv_len = prefix_len + hi  # causal: later keys are never needed by this chunk
            rows = q[q_start + lo : q_start + hi].float()
            q_group = rows.view(hi - lo, num_kv_heads, group_size, head_dim).permute(1, 2, 0, 3)
            scores = q_group @ k[:, :, :kv_len].transpose(-1, -2) * scale  # [kv, g, n, kv_len]
            q_pos = torch.arange(prefix_len + lo, prefix_len + hi, device=q.device)
            future = torch.arange(kv_len, device=q.device)[None, :] > q_pos[:, None]
            probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
            o = probs @ v[:, :, :kv_len]  # [kv_heads, group, n, dim]
            result[q_start + lo : q_start + hi] = o.permute(2, 0, 1, 3).reshape(
                hi - lo, num_q_heads, head_dim
            )
    if out is None:
        return result.to(q.dtype)
    return out.copy_(result)

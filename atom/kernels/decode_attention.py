"""Decode attention over the paged KV cache: one new query token per sequence.

Shapes and dtypes:
    q              [batch, num_q_heads, head_dim], fp16/bf16/fp32
    k_cache,
    v_cache        [num_blocks, block_size, num_kv_heads, head_dim], contiguous; q's dtype,
                   or torch.float8_e4m3fn with k_scale / v_scale
    k_scale,
    v_scale        [num_blocks, block_size, num_kv_heads] float32 (fp8 cache only): a cached
                   row is q_fp8 * scale (see atom/kernels/kv_cache.py)
    block_tables   [batch_capacity >= batch, max_blocks_per_seq], int32; row b holds the
                   block ids of sequence b, entries past its context are ignored
    context_lens   [batch], int32: KV tokens of each sequence in the cache, the current token
                   included; 0 marks a padding row (CUDA-graph padding) whose output is zeros
    out            [batch, num_q_heads, head_dim], q's dtype

GQA: query head h reads kv head h // (num_q_heads // num_kv_heads).

Runtime lengths: batch and context_lens (read on the device, so the kernel can be captured
in a CUDA graph and replayed with other lengths), the number of context splits (the grid)
and the block-table row stride (the page-table width), in do_not_specialize. Geometry
(constexpr): head_dim, block_size, group size, tile sizes, whether the cache is fp8. Whether
the context is split is a runtime branch, not a constexpr, so one compiled variant serves
every batch size.

Kernel design: one program per (sequence, kv head, context split). It holds the whole
query-head group of its kv head as a [BLOCK_G, BLOCK_D] tile, walks its share of the
context in tiles of BLOCK_N tokens gathered through the block table, and keeps an online
softmax in fp32. With several splits (long contexts, small batches) a second kernel merges
the partial results by their log-sum-exp.

Under programmatic dependent launch (atom/kernels/pdl.py) a program reads its context
length and first tile's block ids before it waits for the kernel before it and, with
``early_kv`` (a layer whose qkv projection is a latency-bound GEMV, which lets paged decode
start early at batch 1: the SmolLM2-135M shape's), the first tile's cached K and V too:
all but this step's token, the only one the previous kernel writes, loaded after the wait.

fp8 cache: K and V tiles are loaded as e4m3 and widened to q's dtype (exact), the scales
are applied outside the dots: scores column n is multiplied by k_scale[n], and the softmax
weights by v_scale[n] before the P @ V product (the normaliser uses the unscaled weights).
"""

import torch

from atom.kernels.kv_cache import dequantize_fp8_reference, is_quantized
from atom.kernels.pdl import pdl_launch, pdl_wait_and_release
from atom.kernels.platform import dot_precision, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)

MAX_SPLITS = 32  # the default split cap, the merge kernel's tile: one variant for every count
# The engine's launch knobs when a call leaves them None (benchmarks.decode_ab's dec_*
# variants set them; None: Triton's defaults)
NUM_WARPS: int | None = None
NUM_STAGES: int | None = None
PROGRAMS_PER_SM = 2  # the split count aims at this many programs per SM (then the cap)
SKIP_EMPTY_SPLITS = False  # the default of paged_decode_attention's skip_empty_splits
# False: no cached K / V before the PDL wait, whatever early_kv says (the A/B's no_early_kv)
PDL_EARLY_KV = True


@triton.jit(do_not_specialize=["stride_block_tables_row", "min_split_tokens"])
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    partial_out_ptr,  # [batch, num_q_heads, num_splits, HEAD_DIM] fp32, used when split
    partial_lse_ptr,  # [batch, num_q_heads, num_splits] fp32, log2 domain, used when split
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp32, used when KV_FP8
    v_scale_ptr,
    sm_scale,
    stride_q_batch,
    stride_q_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_scale_block,
    stride_scale_offset,
    stride_block_tables_row,
    stride_out_batch,
    stride_out_head,
    min_split_tokens,  # a split's least share of the context (0: an even share)
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP_SIZE padded to a power of 2 >= 16 for tl.dot
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    BLOCK_N: tl.constexpr,  # tokens per tile
    KV_FP8: tl.constexpr,  # e4m3 cache with per-(token, head) scales
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else a GPU rounds them to TF32
    PDL: tl.constexpr = 0,  # programmatic dependent launch (atom/kernels/pdl.py)
    EARLY_KV: tl.constexpr = True,  # PDL: the first tile's cached K / V before the wait
    SKIP_EMPTY: tl.constexpr = False,  # splits without tokens store nothing (merge reads lens)
    DIRECT: tl.constexpr = False,  # split 0 alone has tokens: it writes out, the merge skips
):
    batch_idx = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    # The step's lengths and block table are written before the forward's first kernel:
    # under PDL they are read (with the first tile's block ids) before the wait.
    context_len = tl.load(context_lens_ptr + batch_idx)
    _decode_split(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, out_ptr, partial_out_ptr,
        partial_lse_ptr, k_scale_ptr, v_scale_ptr, sm_scale,
        stride_q_batch, stride_q_head, stride_cache_block, stride_cache_offset,
        stride_cache_head, stride_scale_block, stride_scale_offset,
        stride_block_tables_row, stride_out_batch, stride_out_head, batch_idx, kv_head,
        split, num_splits, context_len, min_split_tokens, GROUP_SIZE, BLOCK_G, HEAD_DIM,
        BLOCK_D, BLOCK_SIZE, BLOCK_N, KV_FP8, DOT_PRECISION, PDL, EARLY_KV, SKIP_EMPTY, DIRECT,
    )  # fmt: skip


@triton.jit
def _decode_split(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, out_ptr, partial_out_ptr,
    partial_lse_ptr, k_scale_ptr, v_scale_ptr, sm_scale,
    stride_q_batch, stride_q_head, stride_cache_block, stride_cache_offset,
    stride_cache_head, stride_scale_block, stride_scale_offset,
    stride_block_tables_row, stride_out_batch, stride_out_head, batch_idx, kv_head,
    split, num_splits, context_len, min_split_tokens,
    GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr, EARLY_KV: tl.constexpr, SKIP_EMPTY: tl.constexpr, DIRECT: tl.constexpr,
):  # fmt: skip
    # Split `split` of `num_splits`: its share of the context, in whole tiles; empty when
    # context_len == 0 (or, with min_split_tokens, past the splits the context fills).
    tokens_per_split = _split_tokens(context_len, num_splits, min_split_tokens, BLOCK_N)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q_head = kv_head * GROUP_SIZE + offs_g
    g_mask = offs_g < GROUP_SIZE
    d_mask = offs_d < HEAD_DIM

    # The first tile's block ids (token -> block id from the table; int64 past 2^31),
    # before the PDL wait: what the previous kernel writes (q, this token's K / V) after.
    block_table_row = block_tables_ptr + batch_idx * stride_block_tables_row
    first = start + offs_n
    block_id = tl.load(block_table_row + first // BLOCK_SIZE, mask=first < end, other=0).to(
        tl.int64
    )
    if PDL > 0 and EARLY_KV:
        # Under PDL the first tile's K and V too, but for this step's token (the context's
        # last): earlier steps cached them, the previous kernel writes only that one.
        early = (first < end) & (first < context_len - 1)
        first_offs = (
            block_id * stride_cache_block
            + (first % BLOCK_SIZE) * stride_cache_offset
            + kv_head * stride_cache_head
        )
        early_mask = early[:, None] & d_mask[None, :]
        k_early = tl.load(k_cache_ptr + first_offs[:, None] + offs_d[None, :], mask=early_mask, other=0.0)  # fmt: skip
        v_early = tl.load(v_cache_ptr + first_offs[:, None] + offs_d[None, :], mask=early_mask, other=0.0)  # fmt: skip
    pdl_wait_and_release(PDL)

    q_ptrs = q_ptr + batch_idx * stride_q_batch + q_head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    dtype = q_ptr.dtype.element_ty  # of the dots: an fp8 cache is widened to it exactly

    # Finite initial max: a fully masked tile then gives exp2(-inf) = 0, never NaN.
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # softmax via exp2

    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        n_mask = pos < end
        token_offs = (
            block_id * stride_cache_block
            + (pos % BLOCK_SIZE) * stride_cache_offset
            + kv_head * stride_cache_head
        )
        kv_mask = n_mask[:, None] & d_mask[None, :]
        if PDL > 0 and EARLY_KV:  # the first tile: only the rows not loaded before the wait
            late = ((pos >= start + BLOCK_N) | (pos >= context_len - 1))[:, None]
            kv_mask = kv_mask & late
        k = tl.load(k_cache_ptr + token_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + token_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if PDL > 0 and EARLY_KV:
            k = tl.where(late, k, k_early)
            v = tl.where(late, v, v_early)
        next_pos = pos + BLOCK_N  # the next tile's block ids, one tile ahead
        next_block_id = tl.load(
            block_table_row + next_pos // BLOCK_SIZE, mask=next_pos < end, other=0
        ).to(tl.int64)

        qk = tl.dot(q, tl.trans(k.to(dtype)), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        if KV_FP8:
            scale_offs = block_id * stride_scale_block + (pos % BLOCK_SIZE) * stride_scale_offset
            k_scale = tl.load(k_scale_ptr + scale_offs + kv_head, mask=n_mask, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_offs + kv_head, mask=n_mask, other=0.0)
            qk = qk * k_scale[None, :]
        qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v.to(dtype), input_precision=DOT_PRECISION)
        m_i = m_new
        block_id = next_block_id

    out_mask = g_mask[:, None] & d_mask[None, :]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no tokens: acc is 0, output zeros
    acc = acc / l_safe[:, None]
    out_ptrs = (
        out_ptr + batch_idx * stride_out_batch + q_head[:, None] * stride_out_head + offs_d[None, :]
    )
    # Runtime branches: the same compiled kernel serves every split count and length.
    store_out = num_splits == 1
    store_partial = num_splits > 1
    if DIRECT:  # only split 0 has tokens (zeros for a padding row): it writes out, the merge
        # skips the row, the other (empty) splits store nothing
        alone = context_len <= tokens_per_split
        store_out = store_out | (alone & (split == 0))
        store_partial = store_partial & (context_len > tokens_per_split)
    if SKIP_EMPTY:  # the merge reads only the splits the context reaches
        store_partial = store_partial & (start < context_len)
    if store_out:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    if store_partial:
        row = (batch_idx * GROUP_SIZE * tl.num_programs(1) + q_head) * num_splits + split
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(partial_lse_ptr + row, lse, mask=g_mask)
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)


@triton.jit
def _split_tokens(context_len, num_splits, min_split_tokens, BLOCK_N: tl.constexpr):
    """Tokens of each split: an even share of the context in whole tiles, at least
    min_split_tokens (rounded up to whole tiles; 0 for a padding row without a minimum)."""
    even = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(even, tl.cdiv(min_split_tokens, BLOCK_N) * BLOCK_N)


@triton.jit(do_not_specialize=["num_splits", "min_split_tokens"])
def _merge_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    context_lens_ptr,  # read with SKIP_EMPTY or DIRECT
    num_splits,
    min_split_tokens,
    stride_out_batch,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # the split cap >= num_splits, fixed: never depends on the length
    BLOCK_N: tl.constexpr,  # the decode kernel's tile (its split shares are whole tiles)
    PDL: tl.constexpr = 0,
    SKIP_EMPTY: tl.constexpr = False,  # merge only the splits the context reaches
    DIRECT: tl.constexpr = False,  # skip a row whose split 0 alone has tokens (written)
):
    # One program per (sequence, query head): weight each split by exp2(lse - max lse).
    pdl_wait_and_release(PDL)
    batch_idx = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    store_mask = offs_d < HEAD_DIM
    if SKIP_EMPTY or DIRECT:  # the decode kernel's split shares, from the same length
        context_len = tl.load(context_lens_ptr + batch_idx)
        tokens_per_split = _split_tokens(context_len, num_splits, min_split_tokens, BLOCK_N)
        used = tl.cdiv(context_len, tl.maximum(tokens_per_split, 1))
        if DIRECT:  # split 0 wrote the row: nothing to merge
            merged_here = context_len > tokens_per_split
            used = tl.where(merged_here, used, 0)
            store_mask = offs_d < tl.where(merged_here, HEAD_DIM, 0)
        s_mask = s_mask & (offs_s < used)
    row = (batch_idx * tl.num_programs(1) + head) * num_splits + offs_s

    lse = tl.load(partial_lse_ptr + row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all splits empty
    weight = tl.exp2(lse - lse_max)
    partial = tl.load(
        partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    merged = tl.sum(weight[:, None] * partial, 0) / tl.where(total == 0.0, 1.0, total)
    out_ptrs = out_ptr + batch_idx * stride_out_batch + head * stride_out_head + offs_d
    tl.store(out_ptrs, merged.to(out_ptr.dtype.element_ty), mask=store_mask)


def _pick_num_splits(
    q: torch.Tensor,
    num_kv_heads: int,
    max_context: int,
    split_tokens: int,
    max_splits: int | None = None,
) -> int:
    """Enough programs to fill the GPU; depends on shapes only, so graph replays agree."""
    if not q.is_cuda:
        return 1  # the interpreter pays per program
    programs = q.shape[0] * num_kv_heads
    wanted = triton.cdiv(PROGRAMS_PER_SM * multi_processors(q.device), programs)
    useful = triton.cdiv(max_context, split_tokens)
    return max(1, min(wanted, useful, MAX_SPLITS if max_splits is None else max_splits))


_SM_COUNTS: dict[torch.device, int] = {}


def multi_processors(device: torch.device) -> int:
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    early_kv: bool = False,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_splits: int | None = None,
    min_split_tokens: int = 0,
    skip_empty_splits: bool | None = None,
    single_split_direct: bool = False,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged KV; returns ``out``.

    ``num_splits`` (context splits per sequence, at most ``max_splits``) is picked from the
    shapes when None: PROGRAMS_PER_SM programs per SM (2), no more than the widest
    context (the block table's width) has tiles for (at batch 1 each program then loads
    one tile of its share, the least latency; docs/benchmarks.md). An fp8 cache needs
    ``k_scale`` and ``v_scale``. Runs the Triton kernel on CUDA (or under
    TRITON_INTERPRET=1), the reference otherwise.

    ``early_kv``: under PDL, load the first tile's cached K / V before waiting for the
    previous kernel. It pays behind a kernel that lets this one start early (a latency-bound
    qkv GEMV at batch 1, ``pdl.latency_bound``), and cost the 1B shape 1% behind one that
    does not; a constant of the layer, never of the step (a constexpr: one variant).

    Launch knobs (benchmarks/decode_attention_sweep.py; the defaults are the engine's):
    ``block_n`` tokens per tile (None: 64 on a GPU, 256 in the interpreter), ``num_warps`` /
    ``num_stages`` (None: the module's NUM_WARPS / NUM_STAGES), ``max_splits`` the split
    cap (None: MAX_SPLITS; a power of 2 >= num_splits: the merge kernel's tile, so a
    constant per cap, never per length). ``min_split_tokens``: a split's least share of the context (a runtime value: at a short
    context fewer splits have tokens, the rest only wait and exit). ``skip_empty_splits``
    (None: SKIP_EMPTY_SPLITS): splits without tokens store nothing and the merge reads
    context_lens to merge only the splits the context reaches. ``single_split_direct``:
    when split 0 alone has tokens it writes ``out`` and the merge skips the row. None of
    them won inside the engine's batch-1 chain on the H200 (docs/benchmarks.md): the
    defaults are the kernel as before.
    """
    if not use_triton(q):
        return paged_decode_attention_reference(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            out,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.shape[0] >= batch and context_lens.shape[0] >= batch
    kv_fp8, k_scale, v_scale = check_kv_scales(k_cache, v_cache, k_scale, v_scale, q.dtype)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    group_size = num_q_heads // num_kv_heads
    if block_n is None:  # big tiles in the interpreter (cost per program), 64 tokens on a GPU
        block_n = 64 if q.is_cuda else 256
    max_splits = MAX_SPLITS if max_splits is None else max_splits
    num_warps = NUM_WARPS if num_warps is None else num_warps
    num_stages = NUM_STAGES if num_stages is None else num_stages
    skip_empty_splits = SKIP_EMPTY_SPLITS if skip_empty_splits is None else skip_empty_splits
    assert max_splits >= 1 and max_splits & (max_splits - 1) == 0, "max_splits: a power of 2"
    if num_splits is None:  # one tile per split, room allowing
        max_context = block_tables.shape[1] * block_size
        num_splits = _pick_num_splits(q, num_kv_heads, max_context, block_n, max_splits)
    assert 1 <= num_splits <= max_splits, f"num_splits must be in 1..{max_splits}"
    assert min_split_tokens >= 0
    split = num_splits > 1
    # Placeholders of the split buffers' dtype when not split: the pointer dtypes are part
    # of the compiled signature, so both cases share one variant.
    partial_out = partial_lse = placeholder(q.device)
    if split:
        partial_lse = q.new_empty((batch, num_q_heads, num_splits), dtype=torch.float32)
        partial_out = q.new_empty((*partial_lse.shape, head_dim), dtype=torch.float32)
    block_d = max(16, triton.next_power_of_2(head_dim))
    pdl, launch = pdl_launch(q)
    decode_launch = dict(launch)
    if num_warps is not None:
        decode_launch["num_warps"] = num_warps
    if num_stages is not None:
        decode_launch["num_stages"] = num_stages
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        partial_out,
        partial_lse,
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
        min_split_tokens,
        GROUP_SIZE=group_size,
        BLOCK_G=max(16, triton.next_power_of_2(group_size)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        KV_FP8=kv_fp8,
        DOT_PRECISION=dot_precision(q.dtype),
        PDL=pdl,
        EARLY_KV=PDL_EARLY_KV and early_kv,
        SKIP_EMPTY=skip_empty_splits,
        DIRECT=single_split_direct,
        **decode_launch,
    )
    if split:
        _merge_splits_kernel[(batch, num_q_heads)](
            partial_out,
            partial_lse,
            out,
            context_lens,
            num_splits,
            min_split_tokens,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=max_splits,
            BLOCK_N=block_n,
            PDL=pdl,
            SKIP_EMPTY=skip_empty_splits,
            DIRECT=single_split_direct,
            **launch,
        )
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch ``paged_decode_attention`` (fp32 math, a Python loop over sequences)."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_q_heads // num_kv_heads
    result = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    for b, context_len in enumerate(context_lens[:batch].tolist()):
        if context_len == 0:
            continue  # padding row: zeros
        blocks = block_tables[b, : (context_len + block_size - 1) // block_size].long()
        # [context, kv_heads, dim] in fp32
        k = gather_kv_reference(k_cache, k_scale, blocks, context_len)
        v = gather_kv_reference(v_cache, v_scale, blocks, context_len)
        q_group = q[b].float().view(num_kv_heads, group_size, head_dim)
        probs = (torch.einsum("hgd,thd->hgt", q_group, k) * scale).softmax(dim=-1)
        result[b] = torch.einsum("hgt,thd->hgd", probs, v).reshape(num_q_heads, head_dim)
    if out is None:
        return result.to(q.dtype)
    return out.copy_(result)


def check_kv_scales(k_cache, v_cache, k_scale, v_scale, q_dtype):
    """(is fp8, k_scale, v_scale) for a kernel launch; placeholders when not fp8."""
    if not is_quantized(k_cache):
        assert k_cache.dtype == q_dtype and v_cache.dtype == q_dtype
        dummy = placeholder(k_cache.device)
        return False, dummy, dummy
    assert v_cache.dtype == k_cache.dtype, "k_cache and v_cache must share their dtype"
    assert k_scale is not None and v_scale is not None, "an fp8 cache needs k_scale and v_scale"
    for scales in (k_scale, v_scale):
        assert scales.shape == k_cache.shape[:3] and scales.dtype == torch.float32
        assert scales.is_contiguous()
    return True, k_scale, v_scale


_PLACEHOLDERS: dict[torch.device, torch.Tensor] = {}


def placeholder(device: torch.device) -> torch.Tensor:
    """A float32 tensor for pointer arguments a launch never reads (one per device)."""
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = torch.zeros(16, dtype=torch.float32, device=device)
    return _PLACEHOLDERS[device]


def gather_kv_reference(cache, scales, blocks, context_len) -> torch.Tensor:
    """The first ``context_len`` tokens of ``blocks`` as [context_len, kv_heads, dim] fp32."""
    if not is_quantized(cache):
        return cache[blocks].flatten(0, 1)[:context_len].float()
    rows = cache.view(torch.uint8)[blocks].view(cache.dtype).flatten(0, 1)[:context_len]
    return dequantize_fp8_reference(rows, scales[blocks].flatten(0, 1)[:context_len])

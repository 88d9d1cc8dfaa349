"""Paged decode attention for small batches and short contexts: one launch, no merge kernel.

The contract of ``paged_decode_attention`` (atom/kernels/decode_attention.py): the same
shapes, dtypes, GQA, fp8 scales and padding rows (context 0 gives zeros), and the same torch
reference (``paged_decode_attention_reference``). Used by the MHA backend on CUDA at
<= MAX_BATCH sequences when ``Fusions.decode_short`` is on (atom/fusions.py).

Why (issue 17): at batch 1 and a few hundred context tokens the decode kernel moves ~1 MB a
layer and costs ~5 us, all latency: serial loop trips over the pages (each a dependent
block-table load, then the K/V loads), a grid sized for long contexts, and a second kernel
that merges the splits. This kernel:

- splits the context into fixed ``split_tokens`` pieces (a runtime argument picked on the
  host from the block-table width, so one CUDA graph serves every context up to the
  captured maximum). The grid has room for the widest row (at most programs_per_sm x SM
  count programs, one wave: past that, the splits get longer); a row uses
  ``cdiv(context_len, split_tokens)`` splits (read on the device), the other programs
  return after one load;
- loads the context length, the query group and the first tile's block ids at once (a
  split's first tile does not depend on the context length), and the next tile's ids
  before the current tile's math, so each loop trip waits on one memory round trip;
- writes the output directly when a row uses one split (no partials, no merge); with
  several, the last split of a (sequence, kv head) to finish (an atomic counter, left at
  zero for the next launch) merges their partial results, merge_chunk() splits at a time.
  The counters are decode_attention.split_counters (shared with Fusions.decode_merge): one
  stream per device runs these launches, as the engine does.

Tile size, split size, num_warps and num_stages are per head geometry: ``CONFIGS`` (pasted
from ``python -m benchmarks.decode_attention_sweep`` on the H200), ``DEFAULT_CONFIG``
for other geometries. Each geometry compiles one variant: batch, context lengths, the split
size and the table width are runtime (do_not_specialize); head_dim, block_size, the group
size, tile sizes and the cache dtype are constexpr.

fp8 cache: as in decode_attention.py (e4m3 widened to q's dtype, k_scale on the scores,
v_scale on the softmax weights before P @ V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.kernels.decode_attention import (
    _multi_processors,
    check_kv_scales,
    paged_decode_attention_reference,
    placeholder,
    split_counters,
)
from atom.kernels.platform import dot_precision, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)

MAX_BATCH = 4  # the benchmark's largest batch; larger batches keep paged_decode_attention
MAX_SPLITS = 128  # a wider table gets longer splits (the grid never grows past this)
MERGE_TILE = 4096  # fp32 elements of partial output merged per loop trip (see merge_chunk)


@dataclass(frozen=True)
class ShortDecodeConfig:
    """Compile-time choices of one head geometry.

    block_n: tokens per tile (one loop trip); split_tokens: context tokens per split, a
    multiple of block_n (contexts up to it run one program per kv head and no merge);
    num_warps, num_stages: Triton launch options; programs_per_sm: the grid's size at most
    (batch x kv heads x splits, over the SM count; past it splits get longer). Programs
    past a row's context still cost a load each: a grid of several waves of them delays
    the kernel's end by a round trip a wave.
    """

    block_n: int
    split_tokens: int
    num_warps: int = 4
    num_stages: int = 1
    programs_per_sm: int = 4

    def __post_init__(self):
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be >= 1, got {self.programs_per_sm}")
        if self.split_tokens < self.block_n or self.split_tokens % self.block_n:
            raise ValueError(
                f"split_tokens ({self.split_tokens}) must be a positive multiple of block_n "
                f"({self.block_n})"
            )


# (num_q_heads, num_kv_heads, head_dim) -> config: the H200 sweep of 2026-12-01
# (python -m benchmarks.decode_attention_sweep; docs/benchmarks.md), the config with the
# smallest worst slowdown against each case's best.
CONFIGS: dict[tuple[int, int, int], ShortDecodeConfig] = {
    (32, 8, 64): ShortDecodeConfig(
        block_n=256, split_tokens=256, num_warps=4, num_stages=1, programs_per_sm=4
    ),
    (9, 3, 64): ShortDecodeConfig(
        block_n=256, split_tokens=256, num_warps=4, num_stages=1, programs_per_sm=4
    ),
}
DEFAULT_CONFIG = ShortDecodeConfig(block_n=128, split_tokens=256, num_warps=4, num_stages=1)
WIDE_HEADS_CONFIG = ShortDecodeConfig(block_n=64, split_tokens=256, num_warps=8, num_stages=1)


def config_for(num_q_heads: int, num_kv_heads: int, head_dim: int) -> ShortDecodeConfig:
    """The geometry's entry of CONFIGS; else DEFAULT_CONFIG, or for head_dim > 128 (K and V
    tiles twice as wide) WIDE_HEADS_CONFIG."""
    default = DEFAULT_CONFIG if head_dim <= 128 else WIDE_HEADS_CONFIG
    return CONFIGS.get((num_q_heads, num_kv_heads, head_dim), default)


@triton.jit(do_not_specialize=["split_tokens", "table_width", "stride_block_tables_row"])
def _short_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    partial_out_ptr,  # [batch, num_q_heads, num_splits, HEAD_DIM] fp32, rows of > 1 split
    partial_lse_ptr,  # [batch, num_q_heads, num_splits] fp32, log2 domain
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp32, used when KV_FP8
    v_scale_ptr,
    split_counters_ptr,  # [>= batch * num_kv_heads] int32 zeros
    sm_scale,
    split_tokens,  # context tokens per split, a multiple of BLOCK_N
    table_width,  # block-table entries per row (the captured maximum context)
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
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP_SIZE padded to a power of 2 >= 16 for tl.dot
    BLOCK_GM: tl.constexpr,  # GROUP_SIZE padded to a power of 2, for the merge
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    BLOCK_N: tl.constexpr,  # tokens per tile
    MERGE_CHUNK: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # bf16 under TRITON_INTERPRET=1 (see _interpreted_bf16)
):
    batch_idx = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    num_splits = tl.num_programs(2)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q_head = kv_head * GROUP_SIZE + offs_g
    g_mask = offs_g < GROUP_SIZE
    d_mask = offs_d < HEAD_DIM

    # Three independent loads, in flight together: the context length, the query group and
    # the block ids of this split's first tile (in the table's bounds; entries past the
    # context are never used: the K/V loads are masked by it).
    context_len = tl.load(context_lens_ptr + batch_idx)
    q_ptrs = q_ptr + batch_idx * stride_q_batch + q_head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    block_table_row = block_tables_ptr + batch_idx * stride_block_tables_row
    start = split * split_tokens
    entry = (start + offs_n) // BLOCK_SIZE
    block_ids = tl.load(block_table_row + entry, mask=entry < table_width, other=0)

    used_splits = tl.maximum(tl.cdiv(context_len, split_tokens), 1)  # 1 for padding rows
    if split < used_splits:
        dtype = q_ptr.dtype.element_ty  # of the dots: an fp8 cache is widened to it exactly
        if DOT_IN_FP32:
            q = q.to(tl.float32)
        end = tl.minimum(start + split_tokens, context_len)
        # Finite initial max: a fully masked tile then gives exp2(-inf) = 0, never NaN.
        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        qk_scale = sm_scale * 1.4426950408889634  # softmax via exp2
        for tile_start in range(start, end, BLOCK_N):
            pos = tile_start + offs_n
            n_mask = pos < end
            in_block = pos % BLOCK_SIZE
            token_offs = (
                block_ids.to(tl.int64) * stride_cache_block
                + in_block * stride_cache_offset
                + kv_head * stride_cache_head
            )
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(
                k_cache_ptr + token_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0
            )
            v = tl.load(
                v_cache_ptr + token_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0
            )
            if KV_FP8:
                scale_offs = (
                    block_ids.to(tl.int64) * stride_scale_block + in_block * stride_scale_offset
                )
                k_scale = tl.load(k_scale_ptr + scale_offs + kv_head, mask=n_mask, other=0.0)
                v_scale = tl.load(v_scale_ptr + scale_offs + kv_head, mask=n_mask, other=0.0)
            # the next tile's block ids, before this tile's math
            next_pos = pos + BLOCK_N
            block_ids = tl.load(
                block_table_row + next_pos // BLOCK_SIZE, mask=next_pos < end, other=0
            )

            k = k.to(dtype)
            v = v.to(dtype)
            if DOT_IN_FP32:  # exact widening: the same products, summed in fp32 as on a GPU
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if KV_FP8:
                qk = qk * k_scale[None, :]
            qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if KV_FP8:
                p = p * v_scale[None, :]
            p = p.to(dtype)  # rounded to q's dtype for the P @ V dot, as on a GPU
            if DOT_IN_FP32:
                p = p.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            m_i = m_new

        out_mask = g_mask[:, None] & d_mask[None, :]
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no tokens (padding row): zeros
        acc = acc / l_safe[:, None]
        if used_splits == 1:  # a runtime branch: one compiled kernel for every length
            out_ptrs = (
                out_ptr
                + batch_idx * stride_out_batch
                + q_head[:, None] * stride_out_head
                + offs_d[None, :]
            )
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            num_q_heads = num_kv_heads * GROUP_SIZE
            row = (batch_idx * num_q_heads + q_head) * num_splits + split
            lse = m_i + tl.log2(l_safe)  # every used split has tokens
            tl.store(partial_lse_ptr + row, lse, mask=g_mask)
            tl.store(
                partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask
            )
            # The last split to arrive merges: every thread's partial stores precede the
            # counter's release (barrier, then an acq_rel atomic); the merging program reads
            # the others' after its acquire, from L2 (.cg).
            tl.debug_barrier()
            counter = split_counters_ptr + batch_idx * num_kv_heads + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == used_splits - 1:
                _merge_partials(
                    partial_out_ptr, partial_lse_ptr, out_ptr, batch_idx, kv_head, num_q_heads,
                    num_splits, used_splits, stride_out_batch, stride_out_head, GROUP_SIZE,
                    BLOCK_GM, HEAD_DIM, BLOCK_D, MERGE_CHUNK,
                )  # fmt: skip
                tl.atomic_xchg(counter, 0)  # ready for the next launch (graph replays too)


@triton.jit
def _merge_partials(
    partial_out_ptr, partial_lse_ptr, out_ptr, batch_idx, kv_head, num_q_heads, num_splits,
    used_splits, stride_out_batch, stride_out_head, GROUP_SIZE: tl.constexpr,
    BLOCK_GM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
):  # fmt: skip
    # Weights exp2(lse - running max) over [MERGE_CHUNK splits, group] tiles, rescaled as
    # the max grows (an online softmax over splits).
    offs_s = tl.arange(0, MERGE_CHUNK)
    offs_gm = tl.arange(0, BLOCK_GM)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP_SIZE + offs_gm
    gm_mask = offs_gm < GROUP_SIZE
    d_mask = offs_d < HEAD_DIM
    first_rows = (batch_idx * num_q_heads + heads) * num_splits  # [BLOCK_GM], int64
    lse_max = tl.full([BLOCK_GM], -1.0e30, dtype=tl.float32)
    total = tl.zeros([BLOCK_GM], dtype=tl.float32)
    merged = tl.zeros([BLOCK_GM, BLOCK_D], dtype=tl.float32)
    for chunk in range(0, used_splits, MERGE_CHUNK):
        splits = chunk + offs_s
        mask = (splits < used_splits)[:, None] & gm_mask[None, :]  # [MERGE_CHUNK, BLOCK_GM]
        rows = first_rows[None, :] + splits[:, None]
        lse = tl.load(partial_lse_ptr + rows, mask=mask, other=float("-inf"), cache_modifier=".cg")
        new_max = tl.maximum(lse_max, tl.max(lse, 0))
        weight = tl.exp2(lse - new_max[None, :])
        rescale = tl.exp2(lse_max - new_max)
        partial = tl.load(
            partial_out_ptr + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :],
            mask=mask[:, :, None] & d_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        total = total * rescale + tl.sum(weight, 0)
        merged = merged * rescale[:, None] + tl.sum(weight[:, :, None] * partial, 0)
        lse_max = new_max
    merged = merged / tl.where(total == 0.0, 1.0, total)[:, None]  # 0 only in padded rows
    out_ptrs = (
        out_ptr + batch_idx * stride_out_batch + heads[:, None] * stride_out_head + offs_d[None, :]
    )
    tl.store(out_ptrs, merged.to(out_ptr.dtype.element_ty), mask=gm_mask[:, None] & d_mask[None, :])


def _interpreted_bf16(q: torch.Tensor) -> bool:
    """Triton's interpreter computes ``tl.dot`` of bf16 operands wrongly (Triton 3.9: values
    ~1e10 off; fp16 and fp32 are right), so there the kernel widens its bf16 operands to
    fp32 first: exact, and the dots then sum the same products in fp32 as a GPU's."""
    return not q.is_cuda and q.dtype == torch.bfloat16


def merge_chunk(group_size: int, head_dim: int) -> int:
    """Splits merged per loop trip: MERGE_TILE fp32 elements of [splits, group, head_dim]
    (16 splits for a group of 4 at head_dim 64; 2 for 8 at 256, which would spill)."""
    tile = triton.next_power_of_2(group_size) * max(16, triton.next_power_of_2(head_dim))
    return max(2, min(16, MERGE_TILE // tile))


def grid_splits(
    max_context: int,
    config: ShortDecodeConfig,
    programs: int = 1,
    multi_processors: int | None = None,
) -> tuple[int, int]:
    """(split_tokens, num_splits) for a block table holding ``max_context`` tokens a row
    and ``programs`` (sequence, kv head) pairs: the configured split size, longer (whole
    tiles) where more than MAX_SPLITS splits, or more programs than ``programs_per_sm`` x
    ``multi_processors``, would be needed."""
    max_splits = MAX_SPLITS
    if multi_processors is not None:
        max_splits = min(max_splits, max(1, config.programs_per_sm * multi_processors // programs))
    block_n = config.block_n
    longest = triton.cdiv(max_context, max_splits * block_n) * block_n
    split_tokens = max(config.split_tokens, longest)
    return split_tokens, max(1, triton.cdiv(max_context, split_tokens))


def paged_decode_attention_short(
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
    config: ShortDecodeConfig | None = None,
) -> torch.Tensor:
    """``paged_decode_attention`` in one launch (module docstring); returns ``out``.

    ``config`` defaults to the geometry's entry of CONFIGS. The split count comes from the
    block table's width (the captured maximum context), never from the lengths, so a CUDA
    graph replays it right for any context that fits the table. Runs the Triton kernel on
    CUDA (or under TRITON_INTERPRET=1), the reference otherwise.
    """
    if not use_triton(q):
        return paged_decode_attention_reference(
            q, k_cache, v_cache, block_tables, context_lens, scale, out,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.shape[0] >= batch and context_lens.shape[0] >= batch
    assert block_tables.stride(1) == 1
    kv_fp8, k_scale, v_scale = check_kv_scales(k_cache, v_cache, k_scale, v_scale, q.dtype)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    config = config or config_for(num_q_heads, num_kv_heads, head_dim)
    table_width = block_tables.shape[1]
    multi_processors = _multi_processors(q.device) if q.is_cuda else None  # no cap on CPU
    split_tokens, num_splits = grid_splits(
        table_width * block_size, config, batch * num_kv_heads, multi_processors
    )
    counters = split_counters(q.device, batch * num_kv_heads)
    partial_out = partial_lse = placeholder(q.device)  # the same pointer dtype: one variant
    if num_splits > 1:
        partial_lse = q.new_empty((batch, num_q_heads, num_splits), dtype=torch.float32)
        partial_out = q.new_empty((*partial_lse.shape, head_dim), dtype=torch.float32)
    group_size = num_q_heads // num_kv_heads
    dot_in_fp32 = _interpreted_bf16(q)
    _short_decode_kernel[(batch, num_kv_heads, num_splits)](
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
        counters,
        scale,
        split_tokens,
        table_width,
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
        GROUP_SIZE=group_size,
        BLOCK_G=max(16, triton.next_power_of_2(group_size)),
        BLOCK_GM=triton.next_power_of_2(group_size),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        MERGE_CHUNK=merge_chunk(group_size, head_dim),
        KV_FP8=kv_fp8,
        DOT_PRECISION="ieee" if dot_in_fp32 else dot_precision(q.dtype),
        DOT_IN_FP32=dot_in_fp32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out

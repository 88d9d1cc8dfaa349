"""DeepSeek-V4 compressor: partial-window state update and compressed-entry emission.

A compressed layer pools each window of ``ratio`` tokens into one entry (HCA: the window's
own rows; CSA, ``overlap``: the previous window's first half (Ca) and this window's second
half (Cb), 2 * ratio rows) with a softmax over the gate plus ``position_bias``, RMS-norms it
and rotates it at the window's first position. Entry w exists once token
``(w + 1) * ratio - 1`` is processed.

State (per sequence, owned by its KV allocation, atom/model_engine/state_slots.py):
``state_kv`` / ``state_gate`` ``[num_state_slots + 1, R, width]`` in the model dtype, the
raw projections of the last R positions at row ``position % R`` (R = 2 * ratio with
overlap, else ratio); the last slot is scratch for padded rows. Entries live in a paged
pool ``[num_blocks + 1, rows, width]`` (`pool_layout`; last block: scratch) addressed
through the sequence's page-table row: entry w sits in block ``row[w * ratio //
block_size]`` at row ``(w * ratio % block_size) // ratio``; an entry longer than a block
(ratio > block_size) is spread over its ``ratio // block_size`` blocks, one slice of its
channels in each, so no block row stays empty (`entry_rows`, `gather_entries`,
`store_entries`; in the kernels `pool_offsets`).

Triton `compressor_decode` (beside `compressor_decode_reference`): one program per row
writes the token's kv/gate rows into the state, and, when the token closes a window,
pools the window (softmax over the rows per channel, fp32), stores the pooled entry in
the model dtype (HF's rounding point), RMS-norms it with the fp32 weight and rotates its
rope channels at the window's first position, in place in the pool row. Rows that close
no window (and padded rows, state slot -1, which write the scratch slot) stop after the
state write. Runtime lengths: the number of rows and the page-table row stride
(do_not_specialize); geometry
constexpr (ratio, dims, block size). Offsets int64. No host sync: CUDA-graph capturable.

DeepSeek-V4.1 (atom/attention/v41.py) takes the same kernel with no position bias
(``HAS_BIAS`` off) and its pooled row written to a ``[B, D]`` latent for every row instead of
the pool (``LATENT``: V4.1 norms, rotates and fake-quantises the latent in the model and
derives its indexer key from it), `compressor_latent_decode`; then one launch stores the rows
that close a group, entry and key (`store_entries_decode`).
"""

from __future__ import annotations

import math

import torch

from atom.kernels.decode_attention import placeholder
from atom.kernels.platform import use_triton
from atom.kernels.v4_rope import apply_interleaved_rope_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


def rows_per_block(block_size: int, ratio: int) -> int:
    if block_size % ratio and ratio % block_size:
        raise ValueError(f"block_size {block_size} and compress ratio {ratio} must divide")
    return max(1, block_size // ratio)


def entry_parts(block_size: int, ratio: int) -> int:
    """Blocks one entry is spread over: ``ratio // block_size`` when an entry spans several
    page-table blocks (HCA: 128 tokens over 8 blocks of 16), else 1."""
    rows_per_block(block_size, ratio)  # checks that they divide
    return max(1, ratio // block_size)


def pool_layout(block_size: int, ratio: int, dim: int) -> tuple[int, int]:
    """(rows, width) of one page-table block of an entry pool of ``dim``-wide entries.

    ratio <= block_size: ``block_size // ratio`` whole entries per block. ratio > block_size:
    every block of the entry's ``ratio // block_size`` holds one slice of its channels
    (part j: channels ``[j * width, (j + 1) * width)`` in block ``row[w * ratio //
    block_size + j]``), so no block row stays empty (docs/architecture.md, "DeepSeek-V4")."""
    parts = entry_parts(block_size, ratio)
    if dim % parts:
        raise ValueError(
            f"entry width {dim} must divide into compress ratio {ratio} / block_size "
            f"{block_size} = {parts} parts (one per block); use block_size "
            f"{ratio // math.gcd(ratio, dim)} or a larger power of two"
        )
    return rows_per_block(block_size, ratio), dim // parts


def entry_rows(block_tables, entry_ids, ratio: int, block_size: int, num_blocks: int):
    """Flat rows ``[B, N, parts]`` of ``pool.view(-1, width)`` holding entries ``entry_ids``
    ``[B, N]`` (any int; -1 reads entry 0) of each row's sequence, part by part."""
    parts = entry_parts(block_size, ratio)
    first_token = entry_ids.long().clamp(min=0)[..., None] * ratio
    column = first_token // block_size + torch.arange(parts, device=entry_ids.device)
    column = column.clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables.long().gather(1, column.flatten(1)).view(column.shape)
    blocks = blocks.clamp(0, num_blocks - 1)
    return blocks * rows_per_block(block_size, ratio) + (first_token % block_size) // ratio


def gather_entries(pool, block_tables, entry_ids, ratio: int, block_size: int):
    """Entries ``[B, N, dim]`` of ``entry_ids`` ``[B, N]`` from ``pool`` ``[num_blocks + 1,
    rows, width]`` (its parts joined)."""
    rows = entry_rows(block_tables, entry_ids, ratio, block_size, pool.shape[0] - 1)
    return pool.view(-1, pool.shape[-1])[rows].flatten(-2)


def store_entries(pool, block_tables, entry_ids, values, ratio: int, block_size: int, keep=None):
    """pool[entries ``entry_ids`` ``[B, N]``] = values ``[B, N, dim]``; where ``keep``
    ``[B, N]`` is False the scratch block (the last) is written instead."""
    num_blocks, width = pool.shape[0] - 1, pool.shape[-1]
    rows = entry_rows(block_tables, entry_ids, ratio, block_size, num_blocks)
    if keep is not None:
        rows = torch.where(keep[..., None], rows, num_blocks * pool.shape[1])
    pool.view(-1, width)[rows] = values.unflatten(-1, (-1, width)).to(pool.dtype)


def pool_entries(kv_rows, gate_rows, norm_weight, eps: float, cos, sin) -> torch.Tensor:
    """kv/gate rows ``[N, L, D]`` (gate with bias, -inf = absent) -> entries ``[N, D]``."""
    weights = gate_rows.softmax(dim=1, dtype=torch.float32).to(kv_rows.dtype)
    pooled = (kv_rows * weights).sum(dim=1)
    x = pooled.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    normed = (norm_weight * x).to(pooled.dtype)
    return apply_interleaved_rope_reference(normed[:, None, :], cos, sin)[:, 0]


def window_rows(state_kv, state_gate, slots, starts, ratio: int, overlap: bool, bias, dim: int):
    """Pooling rows of the windows starting at ``starts`` [B] of state ``slots`` [B].

    Reads rows ``(start + k) % R``; with overlap the Ca half of the previous window first
    (absent, gate -inf, for the first window)."""
    size = state_kv.shape[1]
    offsets = torch.arange(ratio, device=starts.device)
    current = (starts[:, None] + offsets) % size
    kv = state_kv[slots[:, None], current]
    gate = state_gate[slots[:, None], current].float() + bias
    if not overlap:
        return kv, gate
    previous = (starts[:, None] - ratio + offsets) % size
    ca_kv = state_kv[slots[:, None], previous][..., :dim]
    ca_gate = state_gate[slots[:, None], previous][..., :dim].float() + bias[:, :dim]
    ca_gate = ca_gate.masked_fill((starts < ratio)[:, None, None], float("-inf"))
    kv = torch.cat([ca_kv, kv[..., dim:]], dim=1)
    gate = torch.cat([ca_gate, gate[..., dim:]], dim=1)
    return kv, gate


def compressor_decode_reference(
    state_kv: torch.Tensor,
    state_gate: torch.Tensor,
    kv: torch.Tensor,
    gate: torch.Tensor,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    state_slots: torch.Tensor,
    positions: torch.Tensor,
    block_tables: torch.Tensor,
    pool: torch.Tensor,
    ratio: int,
    overlap: bool,
    block_size: int,
) -> None:
    """One new token per row: write its projections into the state, and where it closes a
    window pool the entry into ``pool``. Rows with state slot -1 (padding) touch only the
    scratch slot and block. Static shapes, no host sync (CUDA-graph capturable).

    kv, gate ``[B, width]``; state_slots ``[B]`` int; positions ``[B]`` int64."""
    scratch = state_kv.shape[0] - 1
    slots = torch.where(state_slots < 0, scratch, state_slots).long()
    positions = positions.long()
    state_kv[slots, positions % state_kv.shape[1]] = kv
    state_gate[slots, positions % state_kv.shape[1]] = gate
    dim = norm_weight.shape[-1]  # the entry width (a pool block may hold one part of it)
    starts = ((positions + 1) // ratio - 1).clamp(min=0) * ratio
    kv_rows, gate_rows = window_rows(
        state_kv, state_gate, slots, starts, ratio, overlap, position_bias, dim
    )
    entries = pool_entries(
        kv_rows, gate_rows, norm_weight, eps, cos_table[starts], sin_table[starts]
    )
    emits = ((positions + 1) % ratio == 0) & (state_slots >= 0)
    store_entries(pool, block_tables, starts[:, None] // ratio, entries[:, None], ratio,
                  block_size, emits[:, None])  # fmt: skip


# -- Triton ------------------------------------------------------------------------------------


@triton.jit
def pool_offsets(
    table_row_ptr,
    first_token,
    channels,
    mask,
    num_blocks,
    RATIO: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS_PER_BLOCK: tl.constexpr,
    PART_WIDTH: tl.constexpr,  # the entry width, or one part of it (`pool_layout`)
    PARTS: tl.constexpr,
):
    """Pool offsets (elements) of channels ``channels`` of the entries that start at token
    ``first_token`` (the two broadcast; the caller maps absent entries to token 0), through
    the sequence's page-table row. The block is the entry's first token's, plus the part of
    the channel when an entry spans several blocks (PARTS > 1: those page-table reads are
    guarded by ``mask``, the result's shape). Block ids are clamped to the pool."""
    if PARTS == 1:
        block = tl.load(table_row_ptr + first_token // BLOCK_SIZE).to(tl.int64)
    else:
        column = first_token // BLOCK_SIZE + channels // PART_WIDTH
        block = tl.load(table_row_ptr + column, mask=mask, other=0).to(tl.int64)
    block = tl.minimum(tl.maximum(block, 0), num_blocks - 1)
    return (block * ROWS_PER_BLOCK + (first_token % BLOCK_SIZE) // RATIO) * PART_WIDTH + (
        channels % PART_WIDTH
    )


@triton.jit(do_not_specialize=["num_rows", "stride_tables_row", "num_blocks"])
def _compressor_decode_kernel(
    state_kv_ptr,
    state_gate_ptr,
    kv_ptr,
    gate_ptr,
    bias_ptr,
    norm_weight_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    positions_ptr,
    tables_ptr,
    pool_ptr,
    num_rows,
    eps,
    stride_kv_row,
    stride_gate_row,
    stride_tables_row,
    stride_cos_row,
    num_blocks,
    SCRATCH: tl.constexpr,
    RATIO: tl.constexpr,
    STATE_ROWS: tl.constexpr,  # 2 * RATIO with overlap, else RATIO
    OVERLAP: tl.constexpr,
    DIM: tl.constexpr,  # entry width; the state rows are WIDTH = 2 * DIM with overlap
    WIDTH: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS_PER_BLOCK: tl.constexpr,
    PART_WIDTH: tl.constexpr,  # channels per pool row: DIM, or DIM / PARTS (`pool_layout`)
    PARTS: tl.constexpr,
    BLOCK_W: tl.constexpr,  # tile over the state row width (write)
    BLOCK_D: tl.constexpr,  # tile over the entry channels (pooling)
    BLOCK_L: tl.constexpr,  # next_power_of_2(pooled rows)
    BLOCK_R: tl.constexpr,  # next_power_of_2(ROPE_DIM // 2)
    HAS_BIAS: tl.constexpr,  # V4's position bias on the gate (V4.1: none)
    LATENT: tl.constexpr,  # V4.1: every row's group pooled into pool_ptr [rows, DIM], no more
):
    program = tl.program_id(0)
    if program < num_rows:
        row = program.to(tl.int64)
        own_slot = tl.load(slots_ptr + row).to(tl.int64)
        slot = tl.where(own_slot < 0, SCRATCH, own_slot)
        position = tl.load(positions_ptr + row).to(tl.int64)
        state_row = (slot * STATE_ROWS + position % STATE_ROWS) * WIDTH
        for w0 in range(0, WIDTH, BLOCK_W):
            offs = w0 + tl.arange(0, BLOCK_W)
            mask = offs < WIDTH
            kv = tl.load(kv_ptr + row * stride_kv_row + offs, mask=mask)
            gate = tl.load(gate_ptr + row * stride_gate_row + offs, mask=mask)
            tl.store(
                state_kv_ptr + state_row + offs, kv.to(state_kv_ptr.dtype.element_ty), mask=mask
            )
            tl.store(
                state_gate_ptr + state_row + offs,
                gate.to(state_gate_ptr.dtype.element_ty),
                mask=mask,
            )
        closes = ((position + 1) % RATIO == 0) & (own_slot >= 0)
        if LATENT:  # every row (its partial group too: V4.1 masks the entry's store)
            closes = position >= 0
        if closes:
            tl.debug_barrier()  # the state rows just written are read back below
            start = position - position % RATIO  # position + 1 - RATIO where it closes
            table_row = tables_ptr + row * stride_tables_row
            r = tl.arange(0, BLOCK_L)
            if OVERLAP:  # rows [0, R): the previous window's Ca half; [R, 2R): this Cb half
                token = start - RATIO + r
                channel_base = tl.where(r < RATIO, 0, DIM)
                present = (r < 2 * RATIO) & ((r >= RATIO) | (start + r * 0 >= RATIO))  # vector mask
            else:
                token = start + r
                channel_base = r * 0
                present = r < RATIO
            token = tl.where(present, token, 0)
            rows = (slot * STATE_ROWS + token % STATE_ROWS) * WIDTH + channel_base
            sum_squares = 0.0
            for d0 in range(0, DIM, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                tile_mask = present[:, None] & (offs_d < DIM)[None, :]
                ptrs = rows[:, None] + offs_d[None, :]
                kv_tile = tl.load(state_kv_ptr + ptrs, mask=tile_mask, other=0.0).to(tl.float32)
                gate_tile = tl.load(state_gate_ptr + ptrs, mask=tile_mask, other=0.0).to(tl.float32)
                if HAS_BIAS:
                    bias = tl.load(bias_ptr + (token % RATIO)[:, None] * WIDTH
                                   + channel_base[:, None] + offs_d[None, :], mask=tile_mask,
                                   other=0.0)  # fmt: skip
                    gate_tile = gate_tile + bias
                gate_tile = tl.where(tile_mask, gate_tile, float("-inf"))
                top = tl.max(gate_tile, axis=0)
                top = tl.where(top == float("-inf"), 0.0, top)
                weights = tl.exp(gate_tile - top[None, :])
                weights = weights / tl.sum(weights, axis=0)[None, :]
                pooled = tl.sum(kv_tile * weights, axis=0).to(pool_ptr.dtype.element_ty)
                if LATENT:
                    tl.store(pool_ptr + row * DIM + offs_d, pooled, mask=offs_d < DIM)
                else:
                    out = pool_ptr + pool_offsets(
                        table_row, start, offs_d, offs_d < DIM, num_blocks, RATIO,
                        BLOCK_SIZE, ROWS_PER_BLOCK, PART_WIDTH, PARTS,
                    )  # fmt: skip
                    tl.store(out, pooled, mask=offs_d < DIM)
                    pooled = pooled.to(tl.float32)
                    sum_squares += tl.sum(tl.where(offs_d < DIM, pooled * pooled, 0.0), axis=0)
            if not LATENT:  # V4: norm and rope the entry in place
                tl.debug_barrier()  # the pooled row is read back by every thread
                rstd = 1.0 / tl.sqrt(sum_squares / DIM + eps)
                for d0 in range(0, DIM - ROPE_DIM, BLOCK_D):  # plain channels: norm only
                    offs_d = d0 + tl.arange(0, BLOCK_D)
                    plain_mask = offs_d < DIM - ROPE_DIM
                    out = pool_ptr + pool_offsets(
                        table_row, start, offs_d, plain_mask, num_blocks, RATIO,
                        BLOCK_SIZE, ROWS_PER_BLOCK, PART_WIDTH, PARTS,
                    )  # fmt: skip
                    x = tl.load(out, mask=plain_mask, other=0.0).to(tl.float32)
                    weight = tl.load(norm_weight_ptr + offs_d, mask=plain_mask, other=0.0)
                    normed = (x * rstd * weight).to(pool_ptr.dtype.element_ty)
                    tl.store(out, normed, mask=plain_mask)
                pair = tl.arange(0, BLOCK_R)
                rope_mask = pair < ROPE_DIM // 2
                even = DIM - ROPE_DIM + 2 * pair
                out_even = pool_ptr + pool_offsets(
                    table_row, start, even, rope_mask, num_blocks, RATIO, BLOCK_SIZE,
                    ROWS_PER_BLOCK, PART_WIDTH, PARTS,
                )  # fmt: skip
                out_odd = pool_ptr + pool_offsets(
                    table_row, start, even + 1, rope_mask, num_blocks, RATIO,
                    BLOCK_SIZE, ROWS_PER_BLOCK, PART_WIDTH, PARTS,
                )  # fmt: skip
                x0 = tl.load(out_even, mask=rope_mask, other=0.0).to(tl.float32)
                x1 = tl.load(out_odd, mask=rope_mask, other=0.0).to(tl.float32)
                norm0 = tl.load(norm_weight_ptr + even, mask=rope_mask, other=0.0)
                norm1 = tl.load(norm_weight_ptr + even + 1, mask=rope_mask, other=0.0)
                dtype = pool_ptr.dtype.element_ty
                x0 = (x0 * rstd * norm0).to(dtype).to(tl.float32)  # HF: the norm's output dtype
                x1 = (x1 * rstd * norm1).to(dtype).to(tl.float32)
                cos = tl.load(cos_ptr + start * stride_cos_row + pair, mask=rope_mask, other=0.0)
                sin = tl.load(sin_ptr + start * stride_cos_row + pair, mask=rope_mask, other=0.0)
                cos, sin = cos.to(dtype).to(tl.float32), sin.to(dtype).to(tl.float32)
                tl.store(out_even, (x0 * cos - x1 * sin).to(dtype), mask=rope_mask)
                tl.store(out_odd, (x1 * cos + x0 * sin).to(dtype), mask=rope_mask)


def compressor_decode(
    state_kv, state_gate, kv, gate, position_bias, norm_weight, eps: float, cos_table,
    sin_table, state_slots, positions, block_tables, pool, ratio: int, overlap: bool,
    block_size: int,
) -> None:  # fmt: skip
    """Triton `compressor_decode_reference` (same arguments, same effect)."""
    if not use_triton(kv):
        compressor_decode_reference(
            state_kv, state_gate, kv, gate, position_bias, norm_weight, eps, cos_table,
            sin_table, state_slots, positions, block_tables, pool, ratio, overlap, block_size,
        )  # fmt: skip
        return
    num_rows, width = kv.shape
    if num_rows == 0:
        return
    assert state_kv.is_contiguous() and state_gate.is_contiguous() and pool.is_contiguous()
    assert position_bias.is_contiguous() and kv.stride(1) == 1 and gate.stride(1) == 1
    dim = norm_weight.shape[-1]  # the entry width (a pool block may hold one part of it)
    rows = 2 * ratio if overlap else ratio
    block_l = triton.next_power_of_2(rows)
    _compressor_decode_kernel[(num_rows,)](
        state_kv, state_gate, kv, gate, position_bias, norm_weight, cos_table, sin_table,
        state_slots, positions, block_tables, pool, num_rows, eps, kv.stride(0),
        gate.stride(0), block_tables.stride(0), cos_table.stride(0), pool.shape[0] - 1,
        SCRATCH=state_kv.shape[0] - 1, RATIO=ratio, STATE_ROWS=state_kv.shape[1],
        OVERLAP=overlap, DIM=dim, WIDTH=width, ROPE_DIM=2 * cos_table.shape[1],
        BLOCK_SIZE=block_size, ROWS_PER_BLOCK=pool.shape[1], PART_WIDTH=pool.shape[-1],
        PARTS=entry_parts(block_size, ratio),
        BLOCK_W=min(1024, triton.next_power_of_2(width)),
        BLOCK_D=max(16, min(triton.next_power_of_2(dim), 8192 // block_l)), BLOCK_L=block_l,
        BLOCK_R=max(2, triton.next_power_of_2(cos_table.shape[1])), HAS_BIAS=True,
        LATENT=False,
    )  # fmt: skip


# -- DeepSeek-V4.1: the group's latent, and the emitted entries' store ---------------------------


def pool_groups(kv: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """kv, gate ``[G, ratio, D]`` fp32 -> softmax(gate)-weighted sums ``[G, D]`` in dtype
    (DeepSeek-V4.1's pooling: no position bias; the norm and rope follow in the model)."""
    return (kv * gate.softmax(dim=1, dtype=torch.float32)).sum(dim=1).to(dtype)


def compressor_latent_decode_reference(
    state_kv, state_gate, kv, gate, state_slots, positions, dtype: torch.dtype
) -> torch.Tensor:
    """DeepSeek-V4.1, one new token per row: write its projections kv, gate ``[B, D]`` into
    the state ``[num_state_slots + 1, ratio, D]`` (row ``position % ratio``; state slot -1
    writes the scratch slot), then pool every row's group as it stands (`pool_groups`) ->
    ``[B, D]`` in ``dtype`` (a row that closes no group pools its partial group: the caller
    keeps only the rows that close one)."""
    scratch = state_kv.shape[0] - 1
    slots = torch.where(state_slots < 0, scratch, state_slots).long()
    rows = positions.long() % state_kv.shape[1]
    state_kv[slots, rows] = kv.to(state_kv.dtype)
    state_gate[slots, rows] = gate.to(state_gate.dtype)
    return pool_groups(state_kv[slots], state_gate[slots], dtype)


def compressor_latent_decode(
    state_kv, state_gate, kv, gate, state_slots, positions, dtype: torch.dtype
) -> torch.Tensor:
    """Triton `compressor_latent_decode_reference` (same arguments, same effect and result):
    `_compressor_decode_kernel` with no position bias (HAS_BIAS) and its pooled rows written
    to a ``[B, D]`` output instead of the pool, with no norm or rope (LATENT)."""
    if not use_triton(kv):
        return compressor_latent_decode_reference(
            state_kv, state_gate, kv, gate, state_slots, positions, dtype
        )
    num_rows, width = kv.shape
    latent = torch.empty(num_rows, width, dtype=dtype, device=kv.device)
    if num_rows == 0:
        return latent
    assert state_kv.is_contiguous() and state_gate.is_contiguous()
    assert kv.stride(1) == 1 and gate.stride(1) == 1
    ratio = state_kv.shape[1]
    block_l = triton.next_power_of_2(ratio)
    unused = placeholder(kv.device)  # bias, norm weight, rope tables, page table: not read
    _compressor_decode_kernel[(num_rows,)](
        state_kv, state_gate, kv, gate, unused, unused, unused, unused, state_slots,
        positions, positions, latent, num_rows, 0.0, kv.stride(0), gate.stride(0), 0, 0, 1,
        SCRATCH=state_kv.shape[0] - 1, RATIO=ratio, STATE_ROWS=ratio, OVERLAP=False,
        DIM=width, WIDTH=width, ROPE_DIM=0, BLOCK_SIZE=1, ROWS_PER_BLOCK=1, PART_WIDTH=width,
        PARTS=1, BLOCK_W=min(1024, triton.next_power_of_2(width)),
        BLOCK_D=max(16, min(triton.next_power_of_2(width), 8192 // block_l)), BLOCK_L=block_l,
        BLOCK_R=2, HAS_BIAS=False, LATENT=True,
    )  # fmt: skip
    return latent


def store_entries_decode_reference(
    pool, block_tables, state_slots, positions, entries, ratio: int, block_size: int,
    index_pool=None, keys=None,
) -> None:  # fmt: skip
    """One new token per row: where it closes its group (``(position + 1) % ratio == 0``, a
    live row) store ``entries`` ``[B, D]`` as entry ``position // ratio`` of the row's
    sequence in ``pool`` (and ``keys`` ``[B, K]`` in ``index_pool``); other rows write the
    scratch block (`store_entries`)."""
    positions = positions.long()
    group = (positions // ratio)[:, None]
    emits = (((positions + 1) % ratio == 0) & (state_slots >= 0))[:, None]
    store_entries(pool, block_tables, group, entries[:, None], ratio, block_size, emits)
    if keys is not None:
        store_entries(index_pool, block_tables, group, keys[:, None], ratio, block_size, emits)


@triton.jit
def _store_entry_row(
    values_row_ptr,
    pool_ptr,
    table_row_ptr,
    first_token,
    num_blocks,
    RATIO: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS_PER_BLOCK: tl.constexpr,
    PART_WIDTH: tl.constexpr,
    PARTS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One entry's ``DIM`` channels from ``values_row_ptr`` into its pool row(s)."""
    for d0 in range(0, DIM, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        mask = offs < DIM
        values = tl.load(values_row_ptr + offs, mask=mask)
        out = pool_ptr + pool_offsets(
            table_row_ptr, first_token, offs, mask, num_blocks, RATIO, BLOCK_SIZE,
            ROWS_PER_BLOCK, PART_WIDTH, PARTS,
        )  # fmt: skip
        tl.store(out, values.to(pool_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows", "stride_tables_row", "num_blocks"])
def _store_entries_decode_kernel(
    entries_ptr,
    keys_ptr,  # HAS_KEYS: [B, KEY_DIM]
    index_pool_ptr,  # HAS_KEYS
    pool_ptr,
    slots_ptr,
    positions_ptr,
    tables_ptr,
    num_rows,
    stride_tables_row,
    num_blocks,
    stride_entries_row,
    stride_keys_row,
    RATIO: tl.constexpr,
    DIM: tl.constexpr,
    KEY_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS_PER_BLOCK: tl.constexpr,
    PART_WIDTH: tl.constexpr,
    PARTS: tl.constexpr,
    KEY_PART_WIDTH: tl.constexpr,
    KEY_PARTS: tl.constexpr,
    HAS_KEYS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per row: a row that closes its group stores its entry (and key); the
    others, padded rows included, store nothing."""
    program = tl.program_id(0)
    if program < num_rows:
        row = program.to(tl.int64)
        slot = tl.load(slots_ptr + row)
        position = tl.load(positions_ptr + row).to(tl.int64)
        if ((position + 1) % RATIO == 0) & (slot >= 0):
            first_token = position + 1 - RATIO
            table_row = tables_ptr + row * stride_tables_row
            _store_entry_row(
                entries_ptr + row * stride_entries_row, pool_ptr, table_row, first_token,
                num_blocks, RATIO, DIM, BLOCK_SIZE, ROWS_PER_BLOCK, PART_WIDTH, PARTS, BLOCK_D,
            )  # fmt: skip
            if HAS_KEYS:
                _store_entry_row(
                    keys_ptr + row * stride_keys_row, index_pool_ptr, table_row, first_token,
                    num_blocks, RATIO, KEY_DIM, BLOCK_SIZE, ROWS_PER_BLOCK, KEY_PART_WIDTH,
                    KEY_PARTS, BLOCK_K,
                )  # fmt: skip


def store_entries_decode(
    pool, block_tables, state_slots, positions, entries, ratio: int, block_size: int,
    index_pool=None, keys=None,
) -> None:  # fmt: skip
    """Triton `store_entries_decode_reference` in one launch (entries and keys), except that
    rows closing no group write nothing (not the scratch block)."""
    if not use_triton(entries):
        store_entries_decode_reference(
            pool, block_tables, state_slots, positions, entries, ratio, block_size,
            index_pool, keys,
        )  # fmt: skip
        return
    num_rows, dim = entries.shape
    if num_rows == 0:
        return
    assert pool.is_contiguous() and entries.stride(1) == 1
    has_keys = keys is not None
    if has_keys:
        assert index_pool.is_contiguous() and keys.stride(1) == 1
    else:
        keys, index_pool = entries, pool  # not read
    parts = entry_parts(block_size, ratio)
    _store_entries_decode_kernel[(num_rows,)](
        entries, keys, index_pool, pool, state_slots, positions, block_tables, num_rows,
        block_tables.stride(0), pool.shape[0] - 1, entries.stride(0), keys.stride(0),
        RATIO=ratio, DIM=dim, KEY_DIM=keys.shape[1], BLOCK_SIZE=block_size,
        ROWS_PER_BLOCK=pool.shape[1], PART_WIDTH=pool.shape[-1], PARTS=parts,
        KEY_PART_WIDTH=index_pool.shape[-1], KEY_PARTS=parts, HAS_KEYS=has_keys,
        BLOCK_D=min(1024, triton.next_power_of_2(dim)),
        BLOCK_K=min(1024, triton.next_power_of_2(keys.shape[1])),
    )  # fmt: skip

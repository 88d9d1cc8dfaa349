"""Causal depthwise conv1d + SiLU over the mixed q/k/v channels of a GDN layer.

out[t, c] = silu(sum_j weight[c, j] * x[t - (K - 1) + j, c]), x before position 0 taken from
the sequence's conv state: the last K - 1 inputs it has seen (zeros at its start). SiLU is
the config's `hidden_act`; any other is refused at load (atom/models/registry.py).

Shapes: x ``[T, C]``; weight ``[C, K]``; conv_state ``[num_state_slots + 1, K - 1, C]`` in the
model dtype, one row per state slot (atom/model_engine/state_slots.py), row -1 scratch for
padded rows; state_slots ``[B]`` int32 (-1 = padding); fresh ``[B]`` int32 (!= 0: the
sequence starts at position 0, its state is taken as zero).

- ``causal_conv1d_update_*``: one token per row (decode), static shapes, graph capturable.
- ``causal_conv1d_prefill_*``: varlen over ``cu_seqlens``, any start position (a chunk
  boundary inside a conv window continues from the state). The Triton form computes the
  outputs of every 64-token chunk in parallel (chunk bounds from
  atom/kernels/gdn_chunk.py `chunk_bounds`, on the device), then each sequence's new state.
Each Triton kernel sits beside its reference; no runtime length is a scalar argument (rows
come from the grid, sequence bounds from ``cu_seqlens`` in device memory). Geometry
(constexpr): channels, kernel width, tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels.gdn_chunk import CHUNK, chunk_bounds
from atom.kernels.pdl import pdl_chain_launch, pdl_wait_and_release
from atom.kernels.platform import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


def _rows(state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return torch.where(slots < 0, state.shape[0] - 1, slots).long()


def causal_conv1d_update_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    state_slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """x [B, C], one token per row -> silu(conv) [B, C]; the state rows shift by one."""
    rows = _rows(conv_state, state_slots)
    past = conv_state[rows] * (fresh == 0).to(conv_state.dtype)[:, None, None]
    window = torch.cat([past, x[:, None].to(conv_state.dtype)], dim=1)  # [B, K, C]
    conv_state[rows] = window[:, 1:]
    out = (window.to(weight.dtype) * weight.t()[None]).sum(dim=1)
    return F.silu(out).to(x.dtype)


def causal_conv1d_prefill_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """x [T, C], sequence b owns rows [cu_seqlens[b], cu_seqlens[b + 1]) -> [T, C]."""
    width = weight.shape[1] - 1
    out = torch.empty_like(x)
    cu = cu_seqlens.tolist()  # host read: prefill is never graphed
    rows = _rows(conv_state, state_slots[: len(cu) - 1]).tolist()
    flags = fresh[: len(cu) - 1].tolist()
    for b, (row, is_fresh) in enumerate(zip(rows, flags, strict=True)):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        past = torch.zeros_like(conv_state[row]) if is_fresh else conv_state[row]
        xs = torch.cat([past, x[start:end].to(conv_state.dtype)])  # [K - 1 + n, C]
        conv_state[row] = xs[-width:]
        conv = F.conv1d(xs.t()[None].to(weight.dtype), weight[:, None], groups=weight.shape[0])
        out[start:end] = F.silu(conv[0].t()).to(x.dtype)
    return out


@triton.jit
def _conv1d_update_kernel(
    x_ptr,  # [B, C]
    state_ptr,  # [num_state_slots + 1, K - 1, C]
    weight_ptr,  # [C, K]
    out_ptr,  # [B, C]
    slots_ptr,  # [B] int32
    fresh_ptr,  # [B] int32
    stride_x,
    stride_out,
    scratch_slot,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,  # K
    BLOCK_K: tl.constexpr,  # next power of two >= K
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr = 0,  # programmatic dependent launch (atom/kernels/pdl.py)
):
    # Program (b, c): row b, channels [c * BLOCK_C, ...). Window row j < K - 1 comes from the
    # state, row K - 1 is the new input; the state then keeps rows 1..K-1 of the window.
    # Under PDL the step's metadata, the weight and the state (earlier steps', no kernel of
    # this forward writes it before this one) load before the wait, the input after it.
    row = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_j = tl.arange(0, BLOCK_K)
    mask_c = offs_c < CHANNELS
    slot = tl.load(slots_ptr + row)
    slot = tl.where(slot < 0, scratch_slot, slot).to(tl.int64)
    keep = (tl.load(fresh_ptr + row + offs_j * 0) == 0)[:, None]  # as a column: a mask
    state = state_ptr + slot * (WIDTH - 1) * CHANNELS
    past_mask = (offs_j < WIDTH - 1)[:, None] & mask_c[None, :] & keep
    past = tl.load(state + offs_j[:, None] * CHANNELS + offs_c[None, :], mask=past_mask, other=0.0)
    w_mask = (offs_j < WIDTH)[:, None] & mask_c[None, :]
    w = tl.load(weight_ptr + offs_c[None, :] * WIDTH + offs_j[:, None], mask=w_mask, other=0.0)
    shift_mask = (offs_j < WIDTH - 2)[:, None] & mask_c[None, :] & keep
    shifted = tl.load(
        state + (offs_j + 1)[:, None] * CHANNELS + offs_c[None, :], mask=shift_mask, other=0.0
    )
    pdl_wait_and_release(PDL)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs_c, mask=mask_c, other=0.0)

    window = tl.where((offs_j == WIDTH - 1)[:, None], x[None, :], past)
    acc = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=0)
    acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs_c, acc.to(x.dtype), mask=mask_c)

    shifted = tl.where((offs_j == WIDTH - 2)[:, None], x[None, :].to(shifted.dtype), shifted)
    # Row j is written with row j + 1, which other warps of this program may still be
    # reading (a [BLOCK_K, BLOCK_C] tile can spread its rows over warps): all reads first.
    tl.debug_barrier()
    tl.store(
        state + offs_j[:, None] * CHANNELS + offs_c[None, :],
        shifted,
        mask=(offs_j < WIDTH - 1)[:, None] & mask_c[None, :],
    )


@triton.jit
def _conv1d_prefill_kernel(
    x_ptr,  # [T, C]
    state_ptr,  # [num_state_slots + 1, K - 1, C]
    weight_ptr,  # [C, K]
    out_ptr,  # [T, C]
    cu_seqlens,  # [B + 1] int32
    bounds_ptr,  # [max_chunks, 3] int32 (gdn_chunk.chunk_bounds): first token, end, sequence
    slots_ptr,  # [B] int32
    fresh_ptr,  # [B] int32
    stride_x,
    stride_out,
    scratch_slot,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens of a chunk (gdn_chunk.CHUNK)
    BLOCK_C: tl.constexpr,
):
    # Program (chunk, c): the chunk's tokens at once, channels [c * BLOCK_C, ...), tap by
    # tap. Inputs before the sequence's first new token come from its state (row
    # src - start + K - 1); the state itself is rewritten by _conv1d_prefill_state_kernel,
    # launched after this one (every chunk of a sequence reads the old state first).
    chunk = tl.program_id(0).to(tl.int64)
    first = tl.load(bounds_ptr + chunk * 3).to(tl.int64)
    end = tl.load(bounds_ptr + chunk * 3 + 1).to(tl.int64)
    if end <= first:  # the grid is sized for the most chunks T tokens can make
        return
    seq = tl.load(bounds_ptr + chunk * 3 + 2)
    start = tl.load(cu_seqlens + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq)
    slot = tl.where(slot < 0, scratch_slot, slot).to(tl.int64)
    offs_t = first + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < CHANNELS
    keep = (tl.load(fresh_ptr + seq + offs_t * 0) == 0)[:, None]  # as a column: a mask
    rows = (offs_t < end)[:, None] & mask_c[None, :]
    state = state_ptr + slot * (WIDTH - 1) * CHANNELS
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        src = offs_t - (WIDTH - 1) + j
        in_x = (src >= start)[:, None] & rows
        in_state = (src < start)[:, None] & rows & keep
        xv = tl.load(x_ptr + src[:, None] * stride_x + offs_c[None, :], mask=in_x, other=0.0)
        row = src - start + WIDTH - 1
        sv = tl.load(state + row[:, None] * CHANNELS + offs_c[None, :], mask=in_state, other=0.0)
        w = tl.load(weight_ptr + offs_c * WIDTH + j, mask=mask_c, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    acc = acc / (1.0 + tl.exp(-acc))
    out_ptrs = out_ptr + offs_t[:, None] * stride_out + offs_c[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rows)


@triton.jit
def _conv1d_prefill_state_kernel(
    x_ptr,  # [T, C]
    state_ptr,  # [num_state_slots + 1, K - 1, C]
    cu_seqlens,  # [B + 1] int32
    slots_ptr,  # [B] int32
    fresh_ptr,  # [B] int32
    stride_x,
    scratch_slot,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= K
    BLOCK_C: tl.constexpr,
):
    # Program (b, c): the new state of sequence b, the last K - 1 inputs (some still from
    # the old state if it has fewer than K - 1 new tokens); an empty sequence keeps its own.
    seq = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_j = tl.arange(0, BLOCK_K)
    mask_c = offs_c < CHANNELS
    start = tl.load(cu_seqlens + seq).to(tl.int64)
    end = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq)
    slot = tl.where(slot < 0, scratch_slot, slot).to(tl.int64)
    keep = (tl.load(fresh_ptr + seq + offs_j * 0) == 0)[:, None]  # as a column: a mask
    state = state_ptr + slot * (WIDTH - 1) * CHANNELS
    src = end - (WIDTH - 1) + offs_j
    rows_mask = ((offs_j < WIDTH - 1) & (offs_j * 0 + end > start))[:, None] & mask_c[None, :]
    in_x = (src >= start)[:, None] & rows_mask
    in_state = (src < start)[:, None] & rows_mask & keep
    xv = tl.load(x_ptr + src[:, None] * stride_x + offs_c[None, :], mask=in_x, other=0.0)
    row = src - start + WIDTH - 1
    sv = tl.load(state + row[:, None] * CHANNELS + offs_c[None, :], mask=in_state, other=0.0)
    new = tl.where(in_x, xv.to(sv.dtype), sv)
    # Row j may be written with row j + n of the old state, which other warps of this
    # program may still be reading (rows of the tile can live in different warps).
    tl.debug_barrier()
    tl.store(state + offs_j[:, None] * CHANNELS + offs_c[None, :], new, mask=rows_mask)


def _launch_geometry(conv_state, weight):
    channels, width = weight.shape
    assert conv_state.shape[1:] == (width - 1, channels) and conv_state.is_contiguous()
    assert weight.is_contiguous() and width >= 2
    block_c = min(256, triton.next_power_of_2(channels))
    return channels, width, triton.next_power_of_2(width), block_c


def causal_conv1d_update(x, conv_state, weight, state_slots, fresh) -> torch.Tensor:
    """`causal_conv1d_update_reference` on the Triton kernel (CUDA-graph capturable)."""
    if not use_triton(x):
        return causal_conv1d_update_reference(x, conv_state, weight, state_slots, fresh)
    channels, width, block_k, block_c = _launch_geometry(conv_state, weight)
    assert x.stride(-1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    grid = (x.shape[0], triton.cdiv(channels, block_c))
    pdl, launch = pdl_chain_launch(x)
    _conv1d_update_kernel[grid](
        x, conv_state, weight, out, state_slots, fresh, x.stride(0), out.stride(0),
        conv_state.shape[0] - 1, CHANNELS=channels, WIDTH=width, BLOCK_K=block_k,
        BLOCK_C=block_c, PDL=pdl, **launch,
    )  # fmt: skip
    return out


def causal_conv1d_prefill(
    x, conv_state, weight, cu_seqlens, state_slots, fresh, bounds=None
) -> torch.Tensor:
    """`causal_conv1d_prefill_reference` on the Triton kernels (no host read): the outputs
    in parallel over 64-token chunks (``bounds``: `chunk_bounds(cu_seqlens, T)` if the
    caller has it), then the new states."""
    if not use_triton(x):
        return causal_conv1d_prefill_reference(
            x, conv_state, weight, cu_seqlens, state_slots, fresh
        )
    channels, width, block_k, block_c = _launch_geometry(conv_state, weight)
    assert x.stride(-1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_seqs == 0 or x.shape[0] == 0:
        return out
    bounds = chunk_bounds(cu_seqlens, x.shape[0]) if bounds is None else bounds
    chunk_c = min(128, block_c)  # [64, 128] fp32 accumulators
    _conv1d_prefill_kernel[(bounds.shape[0], triton.cdiv(channels, chunk_c))](
        x, conv_state, weight, out, cu_seqlens, bounds, state_slots, fresh, x.stride(0),
        out.stride(0), conv_state.shape[0] - 1, CHANNELS=channels, WIDTH=width,
        BLOCK_T=CHUNK, BLOCK_C=chunk_c,
    )  # fmt: skip
    _conv1d_prefill_state_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        x, conv_state, cu_seqlens, state_slots, fresh, x.stride(0), conv_state.shape[0] - 1,
        CHANNELS=channels, WIDTH=width, BLOCK_K=block_k, BLOCK_C=block_c,
    )  # fmt: skip
    return out

"""DeepSeek-V4 mHC hyper-connections: the pre (mix weights, Sinkhorn, the weighted collapse
of the streams and the block's input RMSNorm), the post (the block's output expanded back
into the streams) and the head, each in one or two Triton launches, beside their torch
references (the math of atom/models/deepseek_v4.py's `HyperConnection`, `expand` and
`HyperHead` followed by an `FP32RMSNorm`).

Shapes and dtypes (T tokens, N = hc_mult streams, D hidden, K = N * D):
    streams      [T, N, D] model dtype, each token's N * D values contiguous
    fn           [M, K] fp32: M = (2 + N) * N for a block (pre | post | comb), N for the head
    base         [M] fp32
    scale        [3] fp32 (pre, post, comb scales) for a block, [1] for the head
    norm_weight  [D] fp32: the RMSNorm after the collapse (input / post-attention / final)

    mixes = (streams / rms(streams)) @ fn.T                      (rms over the K values, fp32)
    pre   = sigmoid(mixes[:N] * scale[0] + base[:N]) + hc_eps
    post  = 2 * sigmoid(mixes[N:2N] * scale[1] + base[N:2N])
    comb  = Sinkhorn(softmax(mixes[2N:] * scale[2] + base[2N:]) + hc_eps)   [N, N], `iters`
    x     = norm_weight * rmsnorm(sum_n pre[n] * streams[n])       (the sum rounded to dtype)
    post step: streams'[n] = post[n] * out + sum_j comb[j, n] * streams[j]

Launches: `hc_pre` and `hc_head` two (a split-K GEMV of the mixes with the sum of squares,
then the finish); `hc_post` one. The finish runs two programs a token for a block: one
collapses the streams (pre, the weighted sum, the RMSNorm), the other computes post and the
Sinkhorn comb, so at one token the two serial halves overlap; the head has the first only.
The split-K partial sums are added as one tile reduction (a fixed tree: deterministic). The
mixes are scaled by the rms after the GEMV, not before (the same value up to fp32 rounding).

Runtime lengths: none inside the kernels (tokens come from the grid). Geometry (constexpr):
N, D, M, iters, tiles.
"""

from __future__ import annotations

import torch

from atom.kernels.platform import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)

MIX_BLOCK_K = 128  # columns of fn per iteration of the split-K GEMV
MAX_SPLITS = 64
FINISH_WARPS: int | None = None  # the finish launch's warps (None: from D; benchmarks sweep)


@triton.jit
def _hc_mix_partial_kernel(
    streams_ptr,  # [T, K] (the streams of a token, flat)
    fn_ptr,  # [M, K] fp32
    partial_ptr,  # out [T, SPLITS, M + 1] fp32: dots, then the sum of squares
    stride_streams_row,
    K: tl.constexpr,
    M: tl.constexpr,
    M_P2: tl.constexpr,
    SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,  # columns per program (a multiple of BLOCK_K)
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    rows = tl.arange(0, M_P2)
    acc = tl.zeros([M_P2], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(split * CHUNK, split * CHUNK + CHUNK, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        in_k = cols < K
        x = tl.load(streams_ptr + token * stride_streams_row + cols, mask=in_k, other=0.0)
        x = x.to(tl.float32)
        squares += x * x
        w = tl.load(
            fn_ptr + rows[:, None] * K + cols[None, :],
            mask=(rows < M)[:, None] & in_k[None, :],
            other=0.0,
        )
        acc += tl.sum(w * x[None, :], axis=1)
    out = partial_ptr + (token * SPLITS + split) * (M + 1)
    tl.store(out + rows, acc, mask=rows < M)
    tl.store(out + M, tl.sum(squares, axis=0))


@triton.jit
def _split_tile(partial_ptr, offsets, mask, M: tl.constexpr, SPLITS: tl.constexpr,
                SPLITS_P2: tl.constexpr):  # fmt: skip
    """The partial values at ``offsets`` (1-D, < M + 1) of every split: [SPLITS_P2, width],
    zero past SPLITS. Summed over axis 0 by the caller after every load is issued (a load
    after a reduction waits for its barrier)."""
    split = tl.arange(0, SPLITS_P2)
    return tl.load(
        partial_ptr + split[:, None] * (M + 1) + offsets[None, :],
        mask=(split < SPLITS)[:, None] & mask[None, :],
        other=0.0,
    )


@triton.jit
def _stream_rows(streams_ptr, token, stride_streams_row, n, in_n, d, in_d, D: tl.constexpr):
    """A token's streams [N_P2, BLOCK_D] (zero past N and D)."""
    return tl.load(
        streams_ptr + token * stride_streams_row + n[:, None] * D + d[None, :],
        mask=in_n[:, None] & in_d[None, :],
        other=0.0,
    )


@triton.jit
def _collapse_norm(rows, pre, norm_weight, norm_eps, D: tl.constexpr, dtype: tl.constexpr,
                   ROUND_NORMED: tl.constexpr):  # fmt: skip
    """rows [N_P2, BLOCK_D] (zero past N and D), pre [N_P2] fp32 -> the RMSNorm of
    sum_n pre[n] * rows[n] (the sum rounded to ``dtype``), in ``dtype``: V4's norm multiplies
    the weight in fp32 (``FP32RMSNorm``), V4.1's (``ROUND_NORMED``) rounds the normed value
    to ``dtype`` first (``weight * normed.to(dtype)``)."""
    x = tl.sum(pre[:, None] * rows.to(tl.float32), axis=0).to(dtype).to(tl.float32)
    x = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + norm_eps)
    if ROUND_NORMED:
        x = x.to(dtype).to(tl.float32)
    return (norm_weight * x).to(dtype)


@triton.jit
def _hc_collapse_kernel(
    streams_ptr,  # [T, N, D]
    pre_ptr,  # [T, N] fp32
    norm_weight_ptr,  # [D] the model dtype
    out_ptr,  # out [T, D] streams' dtype
    stride_streams_row,
    stride_out_row,
    norm_eps,
    N: tl.constexpr,
    N_P2: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # V4.1's final norm: the streams collapsed by the last site's pre, then its RMSNorm
    token = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, N_P2)
    in_n = n < N
    d = tl.arange(0, BLOCK_D)
    in_d = d < D
    rows = _stream_rows(streams_ptr, token, stride_streams_row, n, in_n, d, in_d, D)
    pre = tl.load(pre_ptr + token * N + n, mask=in_n, other=0.0)
    norm_weight = tl.load(norm_weight_ptr + d, mask=in_d, other=0.0).to(tl.float32)
    x = _collapse_norm(rows, pre, norm_weight, norm_eps, D, out_ptr.dtype.element_ty, True)
    tl.store(out_ptr + token * stride_out_row + d, x, mask=in_d)


@triton.jit
def _hc_finish_kernel(
    partial_ptr,  # [T, SPLITS, M + 1] fp32 from _hc_mix_partial_kernel
    streams_ptr,  # [T, N, D]
    base_ptr,  # [M] fp32
    scale_ptr,  # [3] or [1] fp32
    norm_weight_ptr,  # [D] fp32 (V4) or the model dtype (V4.1)
    carried_pre_ptr,  # [T, N] fp32: the previous site's pre (CARRIED only)
    pre_ptr,  # out [T, N] fp32: this site's pre (CARRIED only)
    post_ptr,  # out [T, N] fp32 (block only)
    comb_ptr,  # out [T, N, N] fp32 (block only)
    out_ptr,  # out [T, D] streams' dtype: the normed collapse
    stride_streams_row,
    stride_out_row,
    mix_eps,
    hc_eps,
    norm_eps,
    N: tl.constexpr,
    N_P2: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    M: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    ITERS: tl.constexpr,
    HEAD: tl.constexpr,  # the head: pre only (M = N, one scale), one program a token
    CARRIED: tl.constexpr,  # V4.1: collapse with carried_pre, store this site's pre
    ROUND_NORMED: tl.constexpr,  # V4.1's RMSNorm: weight * normed.to(dtype)
):
    # Program (token, 0): pre, the collapse and its RMSNorm. Program (token, 1) (block only):
    # post and the Sinkhorn comb, which program 0 does not need, so the two serial halves
    # run side by side. Each program issues all its loads before its first reduction.
    token = tl.program_id(0).to(tl.int64)
    partial = partial_ptr + token * SPLITS * (M + 1)
    split = tl.arange(0, SPLITS_P2)
    n = tl.arange(0, N_P2)
    in_n = n < N
    if tl.program_id(1) == 0:
        d = tl.arange(0, BLOCK_D)
        in_d = d < D
        rows = _stream_rows(streams_ptr, token, stride_streams_row, n, in_n, d, in_d, D)
        norm_weight = tl.load(norm_weight_ptr + d, mask=in_d, other=0.0).to(tl.float32)
        squares = tl.load(partial + split * (M + 1) + M, mask=split < SPLITS, other=0.0)
        pre = _split_tile(partial, n, in_n, M, SPLITS, SPLITS_P2)
        pre_scale = tl.load(scale_ptr)
        pre_base = tl.load(base_ptr + n, mask=in_n)

        if CARRIED:
            carried = tl.load(carried_pre_ptr + token * N + n, mask=in_n, other=0.0)

        rms = tl.rsqrt(tl.sum(squares, axis=0) / (N * D) + mix_eps)
        pre = tl.sum(pre, axis=0) * rms * pre_scale + pre_base
        pre = tl.where(in_n, 1.0 / (1.0 + tl.exp(-pre)) + hc_eps, 0.0)
        if CARRIED:  # this site's pre goes to the next site; the carried one collapses here
            tl.store(pre_ptr + token * N + n, pre, mask=in_n)
            pre = carried
        x = _collapse_norm(rows, pre, norm_weight, norm_eps, D, out_ptr.dtype.element_ty,
                           ROUND_NORMED)  # fmt: skip
        tl.store(out_ptr + token * stride_out_row + d, x, mask=in_d)
    else:
        if not HEAD:
            # comb[a, b]: row a, column b, loaded as the flat [N_P2 * N_P2] pairs
            flat = tl.arange(0, N_P2 * N_P2)
            in_flat = (flat // N_P2 < N) & (flat % N_P2 < N)
            pair = n[:, None] * N + n[None, :]
            in_pair = in_n[:, None] & in_n[None, :]
            squares = tl.load(partial + split * (M + 1) + M, mask=split < SPLITS, other=0.0)
            post = _split_tile(partial, N + n, in_n, M, SPLITS, SPLITS_P2)
            comb = _split_tile(
                partial, 2 * N + (flat // N_P2) * N + flat % N_P2, in_flat, M, SPLITS, SPLITS_P2
            )
            post_scale, comb_scale = tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
            post_base = tl.load(base_ptr + N + n, mask=in_n)
            comb_base = tl.load(base_ptr + 2 * N + pair, mask=in_pair)

            rms = tl.rsqrt(tl.sum(squares, axis=0) / (N * D) + mix_eps)
            post = tl.sum(post, axis=0) * rms * post_scale + post_base
            post = 2.0 / (1.0 + tl.exp(-post))
            tl.store(post_ptr + token * N + n, post, mask=in_n)
            # softmax over b, then Sinkhorn: columns, rows, ...
            comb = tl.reshape(tl.sum(comb, axis=0), (N_P2, N_P2)) * rms * comb_scale + comb_base
            comb = tl.where(in_pair, comb, -1e30)  # padding (N not a power of two)
            comb = tl.exp(comb - tl.max(comb, axis=1)[:, None])
            comb = comb / tl.sum(comb, axis=1)[:, None]
            comb = tl.where(in_pair, comb + hc_eps, 0.0)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
            for _ in tl.static_range(ITERS - 1):
                comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
                comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
            tl.store(comb_ptr + token * N * N + pair, comb, mask=in_pair)


@triton.jit
def _hc_post_kernel(
    out_ptr,  # [T, D] the block's output
    streams_ptr,  # [T, N, D]
    post_ptr,  # [T, N] fp32
    comb_ptr,  # [T, N, N] fp32
    new_ptr,  # out [T, N, D] contiguous
    stride_out_row,
    stride_streams_row,
    N: tl.constexpr,
    N_P2: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND_ONCE: tl.constexpr,  # V4.1: everything in fp32, rounded to dtype once
):
    # Rounded as the torch reference: V4 post (in dtype) * out, comb (in dtype) @ streams
    # summed in fp32, each rounded to dtype, then added; V4.1 (ROUND_ONCE) the same sum with
    # post and comb in fp32 and no rounding before the store.
    token = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = d < D
    j = tl.arange(0, N_P2)
    in_j = j < N
    dtype = new_ptr.dtype.element_ty
    streams = tl.load(
        streams_ptr + token * stride_streams_row + j[:, None] * D + d[None, :],
        mask=in_j[:, None] & in_d[None, :],
        other=0.0,
    ).to(tl.float32)
    out = tl.load(out_ptr + token * stride_out_row + d, mask=in_d, other=0.0).to(tl.float32)
    for stream in tl.static_range(N):
        post = tl.load(post_ptr + token * N + stream)
        comb = tl.load(comb_ptr + token * N * N + j * N + stream, mask=in_j, other=0.0)
        if ROUND_ONCE:
            value = post * out + tl.sum(comb[:, None] * streams, axis=0)
        else:
            post = post.to(dtype).to(tl.float32)
            comb = comb.to(dtype).to(tl.float32)
            mixed = tl.sum(comb[:, None] * streams, axis=0).to(dtype).to(tl.float32)
            value = (post * out).to(dtype).to(tl.float32) + mixed
        tl.store(new_ptr + (token * N + stream) * D + d, value.to(dtype), mask=in_d)


def _mix_partials(streams: torch.Tensor, fn: torch.Tensor):
    tokens, n, d = streams.shape
    k, m = n * d, fn.shape[0]
    splits = min(MAX_SPLITS, triton.cdiv(k, MIX_BLOCK_K))
    chunk = triton.cdiv(triton.cdiv(k, splits), MIX_BLOCK_K) * MIX_BLOCK_K
    splits = triton.cdiv(k, chunk)
    partial = torch.empty(tokens, splits, m + 1, dtype=torch.float32, device=streams.device)
    if tokens:
        _hc_mix_partial_kernel[(tokens, splits)](
            streams, fn, partial, streams.stride(0),
            K=k, M=m, M_P2=triton.next_power_of_2(m), SPLITS=splits, CHUNK=chunk,
            BLOCK_K=MIX_BLOCK_K, num_warps=4,
        )  # fmt: skip
    return partial, splits


def _check(streams: torch.Tensor, fn: torch.Tensor) -> None:
    assert streams.dim() == 3 and streams.stride(2) == 1 and streams.stride(1) == streams.shape[2]
    assert fn.dtype == torch.float32 and fn.is_contiguous()
    assert fn.shape[1] == streams.shape[1] * streams.shape[2]


def _finish(streams, partial, splits, base, scale, norm_weight, mix_eps, hc_eps, norm_eps,
            iters, head, carried_pre=None):  # fmt: skip
    """(post, comb, out); with ``carried_pre`` (V4.1) (pre, post, comb, out)."""
    tokens, n, d = streams.shape
    m = base.shape[0]
    carried = carried_pre is not None
    out = torch.empty(tokens, d, dtype=streams.dtype, device=streams.device)
    pre = torch.empty(tokens if carried else 0, n, dtype=torch.float32, device=streams.device)
    post = torch.empty(0 if head else tokens, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(0 if head else tokens, n, n, dtype=torch.float32, device=streams.device)
    outputs = (pre, post, comb, out) if carried else (post, comb, out)
    if not tokens:
        return outputs
    if carried:
        assert carried_pre.dtype == torch.float32 and carried_pre.shape == (tokens, n)
        carried_pre = carried_pre.contiguous()
    block_d = triton.next_power_of_2(d)
    args = (partial, streams, base, scale, norm_weight, carried_pre if carried else post, pre,
            post, comb, out, streams.stride(0), out.stride(0), float(mix_eps), float(hc_eps),
            float(norm_eps))  # fmt: skip
    geometry = dict(N=n, N_P2=triton.next_power_of_2(n), D=d, BLOCK_D=block_d, M=m,
                    SPLITS=splits, ITERS=iters, HEAD=head, CARRIED=carried,
                    ROUND_NORMED=carried,
                    num_warps=FINISH_WARPS or min(16, max(4, block_d // 512)))  # fmt: skip
    _hc_finish_kernel[(tokens, 1 if head else 2)](
        *args, SPLITS_P2=triton.next_power_of_2(splits), **geometry
    )
    return outputs


def hc_pre(streams, fn, base, scale, norm_weight, iters: int, mix_eps: float, hc_eps: float,
           norm_eps: float):  # fmt: skip
    """(post [T, N] fp32, comb [T, N, N] fp32, x [T, D] streams' dtype) of one mHC block:
    x is the block's input, the collapse of the streams RMS-normed by ``norm_weight``.
    Triton on CUDA (or under the interpreter), the torch reference otherwise."""
    if not use_triton(streams):
        return hc_pre_reference(
            streams, fn, base, scale, norm_weight, iters, mix_eps, hc_eps, norm_eps
        )
    _check(streams, fn)
    partial, splits = _mix_partials(streams, fn)
    return _finish(streams, partial, splits, base, scale, norm_weight, mix_eps, hc_eps,
                   norm_eps, iters, head=False)  # fmt: skip


def hc_pre_carried(streams, carried_pre, fn, base, scale, norm_weight, iters: int,
                   mix_eps: float, hc_eps: float, norm_eps: float):  # fmt: skip
    """DeepSeek-V4.1's site: (pre [T, N] fp32, post, comb, x [T, D] streams' dtype), where
    x collapses the streams with ``carried_pre`` [T, N] fp32 (the previous site's pre) and
    normalizes as V4.1's RMSNorm (``weight * normed.to(dtype)``, ``norm_weight`` in the
    model's dtype), and pre is this site's, for the next. Two launches, as `hc_pre`."""
    if not use_triton(streams):
        return hc_pre_carried_reference(streams, carried_pre, fn, base, scale, norm_weight,
                                        iters, mix_eps, hc_eps, norm_eps)  # fmt: skip
    _check(streams, fn)
    partial, splits = _mix_partials(streams, fn)
    return _finish(streams, partial, splits, base, scale, norm_weight, mix_eps, hc_eps,
                   norm_eps, iters, head=False, carried_pre=carried_pre)  # fmt: skip


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor,
                norm_eps: float) -> torch.Tensor:  # fmt: skip
    """DeepSeek-V4.1's final norm: the streams [T, N, D] collapsed by ``pre`` [T, N] fp32 (the
    last site's), then V4.1's RMSNorm -> [T, D]. One launch."""
    if not use_triton(streams):
        return hc_collapse_reference(streams, pre, norm_weight, norm_eps)
    tokens, n, d = streams.shape
    assert streams.stride(2) == 1 and streams.stride(1) == d
    assert pre.dtype == torch.float32 and pre.shape == (tokens, n)
    out = torch.empty(tokens, d, dtype=streams.dtype, device=streams.device)
    if tokens:
        block_d = triton.next_power_of_2(d)
        _hc_collapse_kernel[(tokens,)](
            streams, pre.contiguous(), norm_weight, out, streams.stride(0), out.stride(0),
            float(norm_eps), N=n, N_P2=triton.next_power_of_2(n), D=d, BLOCK_D=block_d,
            num_warps=min(16, max(4, block_d // 512)),
        )  # fmt: skip
    return out


def hc_head(streams, fn, base, scale, norm_weight, mix_eps: float, hc_eps: float,
            norm_eps: float) -> torch.Tensor:  # fmt: skip
    """The mHC head collapsing the streams [T, N, D] -> [T, D], then the final RMSNorm."""
    if not use_triton(streams):
        return hc_head_reference(streams, fn, base, scale, norm_weight, mix_eps, hc_eps, norm_eps)
    _check(streams, fn)
    partial, splits = _mix_partials(streams, fn)
    return _finish(streams, partial, splits, base, scale, norm_weight, mix_eps, hc_eps,
                   norm_eps, 1, head=True)[2]  # fmt: skip


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            round_once: bool = False):  # fmt: skip
    """streams' [T, N, D] = post[:, n] * out + sum_j comb[:, j, n] * streams[:, j]: V4 rounds
    each product to the streams' dtype, ``round_once`` (V4.1's `expand`) the fp32 sum only."""
    if not use_triton(streams):
        return hc_post_reference(out, streams, post, comb, round_once)
    tokens, n, d = streams.shape
    assert streams.stride(2) == 1 and streams.stride(1) == d and out.stride(-1) == 1
    new = torch.empty(tokens, n, d, dtype=streams.dtype, device=streams.device)
    if tokens:
        block_d = min(1024, triton.next_power_of_2(d))
        _hc_post_kernel[(tokens, triton.cdiv(d, block_d))](
            out, streams, post.contiguous(), comb.contiguous(), new, out.stride(0),
            streams.stride(0), N=n, N_P2=triton.next_power_of_2(n), D=d, BLOCK_D=block_d,
            ROUND_ONCE=round_once, num_warps=4,
        )  # fmt: skip
    return new


# -- torch references (the model's math: HyperConnection, expand, HyperHead, FP32RMSNorm) ----


def _rms_norm_fp32(
    x: torch.Tensor, weight: torch.Tensor, eps: float, round_normed: bool = False
) -> torch.Tensor:
    """V4's `FP32RMSNorm`; ``round_normed``: V4.1's `RMSNorm` (the normed value rounded to
    x's dtype before the weight multiply)."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * (y.to(x.dtype) if round_normed else y)).to(x.dtype)


def _mixes_reference(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return torch.nn.functional.linear(flat, fn.float())


def hc_pre_reference(streams, fn, base, scale, norm_weight, iters, mix_eps, hc_eps, norm_eps):
    pre, post, comb, _ = _mixes_to_weights(streams, fn, base, scale, iters, mix_eps, hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, _rms_norm_fp32(collapsed, norm_weight, norm_eps)


def _mixes_to_weights(streams, fn, base, scale, iters, mix_eps, hc_eps):
    n = streams.shape[1]
    mixes = _mixes_reference(streams, fn, mix_eps)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb, mixes


def hc_pre_carried_reference(streams, carried_pre, fn, base, scale, norm_weight, iters,
                             mix_eps, hc_eps, norm_eps):  # fmt: skip
    pre, post, comb, _ = _mixes_to_weights(streams, fn, base, scale, iters, mix_eps, hc_eps)
    return pre, post, comb, hc_collapse_reference(streams, carried_pre, norm_weight, norm_eps)


def hc_collapse_reference(streams, pre, norm_weight, norm_eps):
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return _rms_norm_fp32(collapsed, norm_weight, norm_eps, round_normed=True)


def hc_head_reference(streams, fn, base, scale, norm_weight, mix_eps, hc_eps, norm_eps):
    mixes = _mixes_reference(streams, fn, mix_eps)
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return _rms_norm_fp32(collapsed, norm_weight, norm_eps)


def hc_post_reference(out, streams, post, comb, round_once=False):
    dtype = streams.dtype
    if round_once:  # V4.1's `expand`
        mixed = torch.matmul(comb.float().transpose(-1, -2), streams.float())
        return (post.float().unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(dtype)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )

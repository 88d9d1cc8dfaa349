"""Neox-style rotary embedding (HF ``rotate_half``) of queries and keys in one launch.

Shapes and dtypes:
    positions      [num_tokens], int32 or int64.
    q              [num_tokens, num_q_heads, head_dim], fp32/bf16/fp16; k: [num_tokens,
                   num_kv_heads, head_dim], same dtype. Both may be strided views (e.g. slices
                   of a fused qkv projection); only head_dim must be unit-stride.
    cos_cache,
    sin_cache      [max_position, head_dim], any float dtype (both halves stored, as
                   ``RotaryEmbedding`` builds them).
    q_out, k_out   new contiguous tensors shaped and typed like q and k.

Numerics: cos/sin are rounded to q's dtype as in ``apply_rotary_reference``, then
``x * cos + rotate_half(x) * sin`` is computed in fp32 and rounded to q's dtype once, where
torch rounds each product and the sum. In fp32 the two agree to about 1e-6 (a GPU may fuse a
product and the sum into an FMA); in bf16/fp16 about a quarter of the elements differ, by
at most about one ulp of the head's largest outputs (cancellation makes it more than one ulp
of a small output), see the tolerance in tests/kernels/test_rotary.py. (Rounding each op in
the kernel would not help: on the GPU the compiler folds an fp32 -> bf16 -> fp32 round trip.)

Runtime lengths (never constexpr): num_tokens. Geometry (constexpr): heads, head_dim, tiles.
"""

import torch

from atom.kernels.platform import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    token,
    stride_src_token,
    stride_src_head,
    stride_dst_token,
    stride_dst_head,
    cos_first,
    sin_first,
    cos_second,
    sin_second,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One token's [NUM_HEADS, head_dim] rows, as first halves x1 and second halves x2:
    # out = x * cos + cat(-x2, x1) * sin, in fp32, rounded once to the output dtype.
    offs_head = tl.arange(0, BLOCK_HEADS)[:, None]
    offs_dim = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_head < NUM_HEADS) & (offs_dim < HALF)
    src = src_ptr + token * stride_src_token + offs_head * stride_src_head + offs_dim
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos_first - x2 * sin_first
    out2 = x2 * cos_second + x1 * sin_second
    dst = dst_ptr + token * stride_dst_token + offs_head * stride_dst_head + offs_dim
    tl.store(dst, out1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, out2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    num_tokens,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_q_out_token,
    stride_q_out_head,
    stride_k_out_token,
    stride_k_out_head,
    stride_cache_position,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per token (the grid is exactly num_tokens): it reads the token's cos/sin
    # row once for all q and k heads.
    token = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    position = tl.load(positions_ptr + token).to(tl.int64)
    offs_dim = tl.arange(0, BLOCK_HALF)[None, :]
    mask = offs_dim < HALF
    cache = position * stride_cache_position + offs_dim
    # Rounded to q's dtype first, as the torch code casts the cache rows.
    cos_first = tl.load(cos_ptr + cache, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin_first = tl.load(sin_ptr + cache, mask=mask, other=0.0).to(dtype).to(tl.float32)
    cos_second = tl.load(cos_ptr + cache + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin_second = tl.load(sin_ptr + cache + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        token,
        stride_q_token,
        stride_q_head,
        stride_q_out_token,
        stride_q_out_head,
        cos_first,
        sin_first,
        cos_second,
        sin_second,
        NUM_Q_HEADS,
        HALF,
        BLOCK_Q_HEADS,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        token,
        stride_k_token,
        stride_k_head,
        stride_k_out_token,
        stride_k_out_head,
        cos_first,
        sin_first,
        cos_second,
        sin_second,
        NUM_KV_HEADS,
        HALF,
        BLOCK_KV_HEADS,
        BLOCK_HALF,
    )


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` by the angles of ``positions``; returns new (q_out, k_out), or
    ``out`` (two tensors shaped like q and k, head_dim unit-stride) written: ``out=(q, k)``
    rotates in place (each element is read and written by one program, reads first; e.g.
    the rotary slice of a partial rotary, ``q[..., :rotary_dim]``).

    Inputs other than ``out`` are not modified. Runs the Triton kernel on CUDA (or under
    TRITON_INTERPRET=1), the torch reference otherwise.
    """
    if not use_triton(q):
        q_out, k_out = apply_rotary_reference(positions, q, k, cos_cache, sin_cache)
        if out is None:
            return q_out, k_out
        out[0].copy_(q_out)
        out[1].copy_(k_out)
        return out
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and k.dtype == q.dtype
    assert positions.shape == (num_tokens,)
    assert head_dim % 2 == 0, "rotate_half needs an even head_dim"
    assert q.stride(2) == 1 and k.stride(2) == 1, "head_dim must be unit-stride"
    assert cos_cache.shape[1] == head_dim and sin_cache.shape == cos_cache.shape
    assert cos_cache.stride(1) == 1 and sin_cache.stride() == cos_cache.stride()
    if out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    else:
        q_out, k_out = out
        assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == q.dtype
        assert q_out.stride(2) == 1 and k_out.stride(2) == 1 and k_out.dtype == k.dtype
    if num_tokens == 0:
        return q_out, k_out
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_cache,
        sin_cache,
        q_out,
        k_out,
        num_tokens,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2,
        BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )
    return q_out, k_out


def apply_rotary_reference(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch ``apply_rotary`` (HF ``apply_rotary_pos_emb`` with ``rotate_half``)."""
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rotary_rows(
    positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The [T, 1, D] cos rows of `positions` and their sin rows with the first half negated,
    for `rotate_rows`: computed once per step, shared by every layer (the CPU engine)."""
    cos = cos_cache[positions].unsqueeze(1).to(dtype)
    sin = sin_cache[positions].unsqueeze(1).to(dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate_rows(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated as ``apply_rotary_reference`` rotates it, in its exact bytes, with
    rows of `rotary_rows`: rotate_half(x) * sin is x rolled by half times the signed sin
    ((-a) * b and a * (-b) round alike). q and k may be one tensor (their heads side by
    side), so a step rotates each layer's q | k in four ops."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

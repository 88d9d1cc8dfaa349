"""RMSNorm with an optional fused residual add, in HF transformers numerics.

Shapes and dtypes:
    x, residual    [num_tokens, hidden] (or [..., hidden]), fp32/bf16/fp16, same dtype; rows
                   may be strided, only the hidden dimension must be unit-stride.
    weight         [hidden], any float dtype.
    out            [num_tokens, hidden], dtype promote(weight, x) (as ``weight * h.to(x.dtype)``).
    new_residual   [num_tokens, hidden], x's dtype: ``x + residual``.

Numerics (equal to ``rms_norm_reference`` up to the order of the fp32 sum of squares): the
residual add is rounded to x's dtype, the normalisation runs in fp32 and is rounded to x's
dtype before the weight multiply, which is rounded to out's dtype. With ``offset``
(Qwen3-Next's and Gemma's norm, HF ``Qwen3NextRMSNorm``): the fp32 normalisation times
``1 + weight`` in fp32, rounded once to x's dtype (out has x's dtype).

Runtime lengths (never constexpr): num_tokens. Geometry (constexpr): hidden, tile sizes.
"""

import torch

from atom.kernels.pdl import pdl_launch, pdl_wait_and_release
from atom.kernels.platform import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


@triton.jit(do_not_specialize=["num_tokens"])
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    num_tokens,
    eps,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    HIDDEN: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OFFSET: tl.constexpr,  # scale by (1 + weight) in fp32, round once (Qwen3-Next)
    BLOCK_T: tl.constexpr,  # rows per program
    BLOCK_H: tl.constexpr,  # next_power_of_2(HIDDEN)
    PDL: tl.constexpr = 0,  # programmatic dependent launch (atom/kernels/pdl.py)
):
    # Each program normalises BLOCK_T whole rows: the row sum needs every element at once.
    pdl_wait_and_release(PDL)
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_t < num_tokens)[:, None] & (offs_h < HIDDEN)[None, :]
    row = offs_t.to(tl.int64)[:, None]
    col = offs_h[None, :]

    x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + col, mask=mask, other=0.0)
        # Rounded to x's dtype like torch's `x + residual`; the norm reads the rounded sum.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + col, x, mask=mask)

    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=1) / HIDDEN
    normed = h * tl.rsqrt(variance + eps)[:, None]
    weight = tl.load(weight_ptr + offs_h, mask=offs_h < HIDDEN, other=0.0).to(tl.float32)
    if OFFSET:
        out = normed * (1.0 + weight)[None, :]
    else:  # Llama: the normalised row is rounded to x's dtype before the weight multiply
        out = weight[None, :] * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + col, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * normalise(x)`` (``(1 + weight) * ...`` with ``offset``); with
    ``residual``, first ``x = x + residual``.

    Returns ``out``, or ``(out, x + residual)`` when ``residual`` is given. Inputs are not
    modified. Runs the Triton kernel on CUDA (or under TRITON_INTERPRET=1), the torch
    reference otherwise.
    """
    if not use_triton(x):
        return rms_norm_reference(x, weight, eps, residual, offset)
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous()
    assert x.stride(-1) == 1, "hidden must be unit-stride"
    x_rows = x.reshape(-1, hidden)  # a view for the usual [num_tokens, hidden] inputs
    out_dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x_rows.shape, dtype=out_dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(-1) == 1, "hidden must be unit-stride"
        residual_rows = residual.reshape(-1, hidden)
        residual_out = torch.empty_like(x_rows)
    else:  # never read: HAS_RESIDUAL is off
        residual_rows = residual_out = x_rows
    num_tokens = x_rows.shape[0]
    if num_tokens > 0:
        block_h = triton.next_power_of_2(hidden)
        # About 4K elements per program: one or two rows of a real model, more for toy ones.
        block_t = max(1, min(16, 4096 // block_h))
        pdl, launch = pdl_launch(x_rows)
        _rms_norm_kernel[(triton.cdiv(num_tokens, block_t),)](
            x_rows,
            residual_rows,
            weight,
            out,
            residual_out,
            num_tokens,
            eps,
            x_rows.stride(0),
            residual_rows.stride(0),
            out.stride(0),
            residual_out.stride(0),
            HIDDEN=hidden,
            HAS_RESIDUAL=residual is not None,
            OFFSET=offset,
            BLOCK_T=block_t,
            BLOCK_H=block_h,
            num_warps=8 if block_t * block_h >= 4096 else 4,
            PDL=pdl,
            **launch,
        )
    out = out.view(*x.shape[:-1], hidden)
    if residual is None:
        return out
    return out, residual_out.view(x.shape)


def rms_norm_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm_reference`` in two torch ops (the residual add, then aten's fused
    ``rms_norm``) where that gives its bytes: fp32 x and weight (the CPU engine's dtype);
    otherwise the reference (in bf16 / fp16 the fused op rounds once where the reference
    rounds before the weight multiply). tests/kernels/test_rmsnorm.py checks they are equal."""
    if not (x.dtype == weight.dtype == torch.float32):
        return rms_norm_reference(x, weight, eps, residual)
    if residual is not None:
        x = residual = x + residual
    out = torch.rms_norm(x, (x.shape[-1],), weight, eps)
    return out if residual is None else (out, residual)


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch ``rms_norm`` (HF transformers' LlamaRMSNorm, plus the residual add; with
    ``offset`` HF's Qwen3NextRMSNorm)."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * (1.0 + weight.float())).to(dtype) if offset else weight * h.to(dtype)
    return out if residual is None else (out, residual)

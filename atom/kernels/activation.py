"""SiLU-and-multiply of a fused gate/up projection (the SwiGLU MLP's activation).

Shapes and dtypes:
    x      [num_tokens, 2 * intermediate] (or [..., 2 * intermediate]): gate | up, fp32/bf16/
           fp16; rows may be strided, only the last dimension must be unit-stride.
    out    [num_tokens, intermediate], x's dtype: silu(gate) * up.

Numerics as torch's ``F.silu(gate) * up``: silu runs in fp32 and is rounded to x's dtype,
then the product is rounded to x's dtype. (The GPU's fp32 ``exp`` may differ from torch's in
the last bit, which can flip a last bf16 bit.)

Runtime lengths (never constexpr): num_tokens. Geometry (constexpr): intermediate, tiles.
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


@triton.jit(do_not_specialize=["num_tokens"])
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    num_tokens,
    stride_x,
    stride_out,
    INTERMEDIATE: tl.constexpr,
    BLOCK_T: tl.constexpr,  # rows per program
    BLOCK_I: tl.constexpr,  # columns per program
):
    # Program (i, j) covers rows [i * BLOCK_T, ...) and columns [j * BLOCK_I, ...) of out.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (offs_t < num_tokens)[:, None] & (offs_i < INTERMEDIATE)[None, :]
    row = offs_t.to(tl.int64)[:, None]
    col = offs_i[None, :]
    dtype = x_ptr.dtype.element_ty

    gate = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + col, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # rounded like torch's F.silu
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + col, out.to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` as a new tensor of shape ``[..., I]``.

    Runs the Triton kernel on CUDA (or under TRITON_INTERPRET=1), the torch reference otherwise.
    """
    if not use_triton(x):
        return silu_and_mul_reference(x)
    assert x.shape[-1] % 2 == 0, "x must hold gate | up halves"
    assert x.stride(-1) == 1, "the last dimension must be unit-stride"
    intermediate = x.shape[-1] // 2
    x_rows = x.reshape(-1, 2 * intermediate)  # a view for the usual [num_tokens, 2I] inputs
    num_tokens = x_rows.shape[0]
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens > 0 and intermediate > 0:
        # Tiles of about 4K elements: 1 row x 4096 columns for a real model (many programs
        # per row keep the GPU busy at small batch), several rows for toy ones.
        block_i = min(4096, triton.next_power_of_2(intermediate))
        block_t = max(1, min(16, 4096 // block_i))
        grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(intermediate, block_i))
        _silu_and_mul_kernel[grid](
            x_rows,
            out,
            num_tokens,
            x_rows.stride(0),
            out.stride(0),
            INTERMEDIATE=intermediate,
            BLOCK_T=block_t,
            BLOCK_I=block_i,
            num_warps=8 if block_t * block_i >= 4096 else 4,
        )
    return out.view(*x.shape[:-1], intermediate)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``silu_and_mul``."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# -- the clamped SwiGLU (DeepSeek-V4's shared expert): gate and up from separate projections --


@triton.jit(do_not_specialize=["num_tokens"])
def _clamped_silu_and_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    num_tokens,
    stride_gate,
    stride_up,
    stride_out,
    limit,
    INTERMEDIATE: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (offs_t < num_tokens)[:, None] & (offs_i < INTERMEDIATE)[None, :]
    row = offs_t.to(tl.int64)[:, None]
    col = offs_i[None, :]
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + row * stride_gate + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # rounded like torch's F.silu
    tl.store(out_ptr + row * stride_out + col, (silu.to(tl.float32) * up).to(dtype), mask=mask)


def clamped_silu_and_mul(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` ([T, I] each, rows may be
    strided; ``limit`` None: no clamp) in one launch; the torch reference where Triton does
    not run."""
    if not use_triton(gate):
        return clamped_silu_and_mul_reference(gate, up, limit)
    assert gate.shape == up.shape and gate.dim() == 2
    assert gate.stride(-1) == 1 and up.stride(-1) == 1
    num_tokens, intermediate = gate.shape
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    if num_tokens > 0 and intermediate > 0:
        block_i = min(4096, triton.next_power_of_2(intermediate))
        block_t = max(1, min(16, 4096 // block_i))
        grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(intermediate, block_i))
        _clamped_silu_and_mul_kernel[grid](
            gate, up, out, num_tokens, gate.stride(0), up.stride(0), out.stride(0),
            0.0 if limit is None else float(limit), INTERMEDIATE=intermediate,
            HAS_LIMIT=limit is not None, BLOCK_T=block_t, BLOCK_I=block_i,
            num_warps=8 if block_t * block_i >= 4096 else 4,
        )  # fmt: skip
    return out


def clamped_silu_and_mul_reference(gate, up, limit: float | None) -> torch.Tensor:
    """The model's torch ops (atom/models/deepseek_v4.py `SwiGLUMLP`)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up


# -- the sigmoid output gate (Qwen3-Next's gated attention) -------------------------------------


@triton.jit
def _sigmoid_gate_kernel(
    x_ptr,  # [T, H * D], unit stride inside a row
    gate_ptr,  # [T, H, D], D unit-stride (e.g. a chunk of q_proj's output)
    out_ptr,  # out [T, H * D] contiguous
    stride_x,
    stride_gate_token,
    stride_gate_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program (t, h): one head of one token; sigmoid rounded like torch's, then the product.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    mask = d < HEAD_DIM
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + token * stride_x + head * HEAD_DIM + d, mask=mask, other=0.0)
    gate_row = gate_ptr + token * stride_gate_token + head * stride_gate_head
    gate = tl.load(gate_row + d, mask=mask, other=0.0).to(tl.float32)
    sigmoid = (1.0 / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out = (x.to(tl.float32) * sigmoid).to(dtype)
    tl.store(out_ptr + token * NUM_HEADS * HEAD_DIM + head * HEAD_DIM + d, out, mask=mask)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` with x [T, H * D] and gate [T, H, D] (strided heads allowed) ->
    [T, H * D] in x's dtype, one launch (torch rounds the sigmoid, then the product); the
    torch reference where Triton does not run. Tokens and heads come from the grid."""
    if not use_triton(x):
        return sigmoid_gate_reference(x, gate)
    tokens, num_heads, head_dim = gate.shape
    assert x.shape == (tokens, num_heads * head_dim) and x.dtype == gate.dtype
    assert x.stride(-1) == 1 and gate.stride(-1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens > 0:
        _sigmoid_gate_kernel[(tokens, num_heads)](
            x, gate, out, x.stride(0), gate.stride(0), gate.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            num_warps=1 if head_dim <= 256 else 4,
        )  # fmt: skip
    return out


def sigmoid_gate_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The model's torch ops (atom/models/qwen3_next.py `Qwen3NextAttention`)."""
    return x * torch.sigmoid(gate.reshape(x.shape))

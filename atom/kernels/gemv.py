"""Small-batch linear layers as Triton GEMVs, optionally with SiLU * up in the epilogue.

At batch 1 a decoder step's linear layers are matrix-vector products bound by reading the
weight once. cuBLAS adds a split-K reduce kernel to some of them, and the MLP's SiLU-and-mul
is a kernel of its own; these kernels read the weight in one pass and write the result
(``gemv``), or read the gate and up rows of the fused gate/up weight together and write
``silu(gate) * up`` directly (``gemv_silu_and_mul``): one launch instead of two or three.
Used only with their Fusions switches (atom/fusions.py) and at most GEMV_MAX_ROWS rows.

Shapes and dtypes:
    x        [num_rows, in_features], fp32/bf16/fp16, rows may be strided, unit-stride
             columns; num_rows <= GEMV_MAX_ROWS.
    weight   [out_features, in_features] (nn.Linear's layout), x's dtype, unit-stride
             columns. For ``gemv_silu_and_mul`` out_features = 2 * intermediate: gate rows
             then up rows (ColumnParallelLinear's [gate | up]).
    out      [num_rows, out_features] (``gemv``) or [num_rows, intermediate], x's dtype.

Numerics: fp32 accumulation (tensor-core dots, the rows padded to 16), rounded to x's dtype
as F.linear's output; with SiLU the gate and up are rounded first, then silu in fp32 rounded,
then the product rounded (atom/kernels/activation.py's order). The summation order differs
from cuBLAS, so a last bit may differ.

Kernel design: one program per BLOCK_N output features; it walks in_features in BLOCK_K
chunks, loading the [BLOCK_K, BLOCK_N] weight tile(s) (contiguous along K) and the x rows,
and accumulates with tl.dot.

Runtime lengths (never constexpr, in do_not_specialize): num_rows. Geometry (constexpr):
in/out features, tiles, whether the SiLU epilogue runs. Offsets are int64 (a 128K x 8K
weight passes 2^31 elements).
"""

import torch

from atom.kernels import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)

GEMV_MAX_ROWS = 16  # the padded rows of one tl.dot: more rows would be a GEMM


@triton.jit(do_not_specialize=["num_rows"])
def _gemv_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    stride_x,
    stride_weight,
    stride_out,
    IN_FEATURES: tl.constexpr,
    OUT_FEATURES: tl.constexpr,  # of out: intermediate when SILU_MUL
    SILU_MUL: tl.constexpr,  # weight rows [gate | up]; out = silu(gate) * up
    BLOCK_M: tl.constexpr,  # GEMV_MAX_ROWS
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # of fp32 dots: "ieee" (no tf32 rounding)
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < num_rows
    n_mask = offs_n < OUT_FEATURES
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    # [BLOCK_K, BLOCK_N] tiles of weight^T: column n is weight row n, contiguous along K.
    gate_cols = weight_ptr + offs_n.to(tl.int64)[None, :] * stride_weight
    up_cols = weight_ptr + (offs_n + OUT_FEATURES).to(tl.int64)[None, :] * stride_weight
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, IN_FEATURES, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < IN_FEATURES
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        gate = tl.load(gate_cols + offs_k[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(x, gate, acc, input_precision=INPUT_PRECISION)
        if SILU_MUL:
            up = tl.load(up_cols + offs_k[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(x, up, acc_up, input_precision=INPUT_PRECISION)
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SILU_MUL:
        # rounded as F.linear's outputs, then as activation.py's silu and product
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        tl.store(out_ptrs, (silu.to(tl.float32) * up).to(dtype), mask=out_mask)
    else:
        tl.store(out_ptrs, acc.to(dtype), mask=out_mask)


def gemv_config(out_features: int, on_gpu: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): geometry only."""
    if not on_gpu:  # the interpreter pays per program: few, big ones
        return min(128, max(16, triton.next_power_of_2(out_features))), 128, 4
    return 16, 256, 4


def fits_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` / ``gemv_silu_and_mul`` take these inputs (rows, dtypes, strides)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_ROWS
        and x.dtype == weight.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, silu_mul: bool) -> None:
    assert fits_gemv(x, weight), "x [rows <= GEMV_MAX_ROWS, K], weight [N, K], one dtype"
    assert weight.shape[1] == x.shape[1]
    out_features = out.shape[1]
    block_n, block_k, num_warps = gemv_config(out_features, x.is_cuda)
    _gemv_kernel[(triton.cdiv(out_features, block_n),)](
        x,
        weight,
        out,
        x.shape[0],
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        IN_FEATURES=x.shape[1],
        OUT_FEATURES=out_features,
        SILU_MUL=silu_mul,
        BLOCK_M=GEMV_MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for at most GEMV_MAX_ROWS rows (no bias).

    Runs the Triton kernel on CUDA (or under TRITON_INTERPRET=1), the reference otherwise.
    """
    if not use_triton(x):
        return gemv_reference(x, weight)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, out, silu_mul=False)
    return out


def gemv_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ weight.T = [gate | up]`` for at most GEMV_MAX_ROWS rows.

    Runs the Triton kernel on CUDA (or under TRITON_INTERPRET=1), the reference otherwise.
    """
    if not use_triton(x):
        return gemv_silu_and_mul_reference(x, weight)
    assert weight.shape[0] % 2 == 0, "weight holds gate | up rows"
    out = torch.empty(x.shape[0], weight.shape[0] // 2, dtype=x.dtype, device=x.device)
    _launch(x, weight, out, silu_mul=True)
    return out


def gemv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``gemv``: F.linear."""
    return torch.nn.functional.linear(x, weight)


def gemv_silu_and_mul_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``gemv_silu_and_mul``: F.linear, then silu(gate) * up."""
    gate, up = torch.nn.functional.linear(x, weight).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up

"""DeepSeek-V4.1 fake quantisation: FP8 / FP4 round trips inside the forward.

V4.1 is trained with quantisation-aware steps that the forward keeps even with float
weights: the value is quantised onto the FP8 (e4m3) or FP4 (e2m1) grid block by block and
dequantised at once, so a float engine sees exactly the values the quantised cache holds.

- FP8 window K=V: blocks of 32 channels (rope tail included), power-of-two (ue8m0) scale
  ``2^ceil(log2(max(amax, 1e-4) / 448))``.
- FP4 indexer q and keys: blocks of 32, ue8m0 scale ``2^ceil(log2(max(amax, 6 * 2^-126) / 6))``.
- FP4 compressed KV: blocks of 16, e4m3 scale ``e4m3(max(amax, 6 * 2^-9) / 6)``.

A last dimension that is not a multiple of the block size is left unquantised (as upstream).
FP4 rounding is round-to-nearest-even on the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}: a value
exactly between two grid points goes to the one with the even code.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between grid neighbours; ties round up where the upper code is even.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (False, True, False, True, False, True, False)


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(t))`` for fp32 ``t > 0`` from the IEEE-754 fields (exact)."""
    bits = t.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    k = exponent - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.exp2(k.float())


def fake_quant_fp8_reference(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x ``[..., n]`` -> the same values after an e4m3 round trip per ``block`` channels."""
    n = x.shape[-1]
    if n % block:
        return x
    blocks = x.float().unflatten(-1, (n // block, block))
    scale = pow2_ceil(blocks.abs().amax(-1).clamp_min(1e-4) * (1.0 / FP8_MAX)).unsqueeze(-1)
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2).to(x.dtype)


def e2m1_round(q: torch.Tensor) -> torch.Tensor:
    """fp32 values already inside [-6, 6] -> the nearest e2m1 grid value (ties to even)."""
    magnitude = q.abs()
    code = torch.zeros_like(magnitude, dtype=torch.int64)
    for midpoint, up in zip(_MIDPOINTS, _TIES_UP, strict=True):
        code += (magnitude >= midpoint if up else magnitude > midpoint).long()
    grid = torch.tensor(FP4_GRID, dtype=torch.float32, device=q.device)
    return torch.where(torch.signbit(q), -grid[code], grid[code])


def fp4_scales(amax: torch.Tensor, e4m3_scales: bool) -> torch.Tensor:
    if e4m3_scales:
        return (amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).to(torch.float8_e4m3fn).float()
    return pow2_ceil(amax.clamp_min(FP4_MAX * 2.0**-126) * (1.0 / FP4_MAX))


def fake_quant_fp4_reference(x: torch.Tensor, block: int, e4m3_scales: bool = False):
    """x ``[..., n]`` -> the same values after an e2m1 round trip per ``block`` channels
    (ue8m0 scales, or e4m3 scales with ``e4m3_scales``)."""
    n = x.shape[-1]
    if n % block:
        return x
    blocks = x.float().unflatten(-1, (n // block, block))
    scale = fp4_scales(blocks.abs().amax(-1), e4m3_scales).unsqueeze(-1)
    q = e2m1_round((blocks / scale).clamp(-FP4_MAX, FP4_MAX))
    return (q * scale).flatten(-2).to(x.dtype)


# -- Triton ----------------------------------------------------------------------------------
# One program fake-quantises ROWS quantisation blocks of BLOCK contiguous channels. The e4m3
# and e2m1 roundings are written out in arithmetic (exponent from the fp32 bits, then
# round-half-even on that binade's step), so the kernel runs the same under the interpreter.
# Runtime length (never constexpr): num_blocks. Geometry (constexpr): BLOCK, ROWS, MODE.
from atom.kernels.platform import use_triton  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: keep the module importable for the references
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)

MODE_FP8, MODE_FP4, MODE_FP4_E4M3 = 0, 1, 2


@triton.jit
def _exponent(x):
    """floor(log2(|x|)) of fp32 x != 0, from the bits (subnormals read as -127)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((r - x == 0.5) & odd, r - 1.0, r)


@triton.jit
def _e4m3(x):
    """x (|x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even."""
    magnitude = tl.abs(x)
    exponent = tl.maximum(_exponent(magnitude), -6)  # below 2^-6: subnormal steps of 2^-9
    step = tl.exp2((exponent - 3).to(tl.float32))
    rounded = _round_half_even(magnitude / step) * step
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def _pow2_ceil(x):
    bits = x.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.exp2(k.to(tl.float32))


@triton.jit
def _e2m1(q):
    m = tl.abs(q)
    v = tl.where(m > 0.25, 0.5, 0.0)
    v = tl.where(m >= 0.75, 1.0, v)
    v = tl.where(m > 1.25, 1.5, v)
    v = tl.where(m >= 1.75, 2.0, v)
    v = tl.where(m > 2.5, 3.0, v)
    v = tl.where(m >= 3.5, 4.0, v)
    v = tl.where(m > 5.0, 6.0, v)
    return tl.where(q < 0, -v, v)


@triton.jit(do_not_specialize=["num_blocks"])
def _fake_quant_kernel(
    x_ptr,
    out_ptr,
    num_blocks,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    MODE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_blocks)[:, None]
    offsets = rows[:, None] * BLOCK + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    if MODE == 0:
        scale = _pow2_ceil(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
        q = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
        y = _e4m3(q) * scale[:, None]
    else:
        if MODE == 1:
            scale = _pow2_ceil(tl.maximum(amax, 6.0 * 1.1754943508222875e-38) * (1.0 / 6.0))
        else:
            scale = _e4m3(tl.maximum(amax, 6.0 * 0.001953125) / 6.0)
        q = tl.minimum(tl.maximum(x / scale[:, None], -6.0), 6.0)
        y = _e2m1(q) * scale[:, None]
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def _fake_quant(x: torch.Tensor, block: int, mode: int) -> torch.Tensor:
    flat = x.contiguous().view(-1, block)
    out = torch.empty_like(flat)
    num_blocks = flat.shape[0]
    if num_blocks:
        rows = 16
        _fake_quant_kernel[(triton.cdiv(num_blocks, rows),)](
            flat, out, num_blocks, BLOCK=block, ROWS=rows, MODE=mode
        )
    return out.view(x.shape)


def fake_quant_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Triton `fake_quant_fp8_reference` (same arguments, same values)."""
    if x.shape[-1] % block:
        return x
    if not use_triton(x):
        return fake_quant_fp8_reference(x, block)
    return _fake_quant(x, block, MODE_FP8)


def fake_quant_fp4(x: torch.Tensor, block: int, e4m3_scales: bool = False) -> torch.Tensor:
    """Triton `fake_quant_fp4_reference` (same arguments, same values)."""
    if x.shape[-1] % block:
        return x
    if not use_triton(x):
        return fake_quant_fp4_reference(x, block, e4m3_scales)
    return _fake_quant(x, block, MODE_FP4_E4M3 if e4m3_scales else MODE_FP4)

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

"""The one-row GEMV's launch geometry: its tile type, the heuristic tile of a shape, and the
tile the GEMV policy chose for a site.

Its own module so that the kernels (atom/kernels/gemv.py, gemv_rope_kv.py) and the policy
that trials them (atom/kernels/gemv_policy.py) share it without importing each other: the
policy hands its choices over with ``use_tile_source`` when it becomes the process's
policy, and ``gemv_config`` asks ``chosen_tile``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GemvConfig:
    """A GEMV kernel's launch geometry."""

    block_n: int  # output features per program
    block_k: int  # input features per chunk of the K loop
    num_warps: int
    num_stages: int  # software-pipelining depth of the K loop


@dataclass(frozen=True)
class GemvSite:
    """A batch-1 linear layer's shape: weight [rows, in_features] (rows = 2 * intermediate
    with the SiLU * up epilogue), with or without the RMSNorm prologue."""

    in_features: int
    rows: int
    silu_mul: bool
    norm: bool
    dtype: str  # "bfloat16", "float32", ...
    rope: bool = False  # q/k/v rows with RoPE and the KV write in the epilogue (gemv_rope_kv)

    def label(self) -> str:
        parts = [f"{self.in_features}x{self.rows}"]
        parts += ["silu"] * self.silu_mul + ["norm"] * self.norm + ["rope_kv"] * self.rope
        return "+".join(parts) + f" {self.dtype}"


# the SMs of a Hopper GPU: the heuristic aims at several programs per SM
_NUM_SMS = 132


def heuristic_config(in_features: int, out_features: int, silu_mul: bool) -> GemvConfig:
    """A launch geometry from the shape alone: the largest BLOCK_N that still gives ~8
    programs per SM, and ~8 KB of weight per tile (32 elements per thread of 4 warps)."""
    rows = out_features // 2 if silu_mul else out_features
    block_n = 16
    while block_n > 1 and -(-rows // block_n) < 8 * _NUM_SMS:
        block_n //= 2
    block_k = max(128, min(2048, 4096 // block_n, 1 << max(in_features - 1, 0).bit_length()))
    return GemvConfig(block_n, block_k, 4, 2 if in_features > block_k else 1)


TileSource = Callable[[GemvSite, torch.device], "GemvConfig | None"]
_tile_source: TileSource | None = None


def use_tile_source(source: TileSource | None) -> TileSource | None:
    """Where ``chosen_tile`` looks (the process's GEMV policy; None: the heuristic's
    tiles); returns the previous source."""
    global _tile_source
    previous, _tile_source = _tile_source, source
    return previous


def chosen_tile(site: GemvSite, device: torch.device) -> GemvConfig | None:
    """The tile the GEMV policy chose for a site (None: none chosen, the heuristic's)."""
    return None if _tile_source is None else _tile_source(site, device)


# bytes of one weight element in the quantized GEMVs (atom/kernels/fp8_linear.py, int4_linear.py)
_QUANT_BYTES = {"fp8": 1.0, "int4": 0.5}


def quant_gemv_config(
    in_features: int,
    out_features: int,
    fmt: str,
    group: int = 0,
    on_gpu: bool = True,
    device: torch.device | None = None,
) -> GemvConfig:
    """The batch-1 quantized GEMV's launch geometry for a weight [out_features, in_features]
    in ``fmt`` ("fp8" or "int4"), its scales in groups of ``group`` inputs (0: one scale
    per output row). The GEMV policy's tile for the site when it chose one (site dtype
    "fp8" / "int4"), else the shape's heuristic: BLOCK_N as ``heuristic_config`` (~8
    programs per SM), BLOCK_K for ~4 KB of weight per tile (16-byte loads per thread of 4
    warps, twice over) and a multiple of ``group``. block_k counts inputs."""
    if not on_gpu:  # the interpreter pays per program: few, big ones
        block_k = max(128, group)
        return GemvConfig(min(64, 1 << max(out_features - 1, 0).bit_length()), block_k, 4, 1)
    site = GemvSite(in_features, out_features, False, False, fmt)
    tile = chosen_tile(site, device or torch.device("cuda"))
    if tile is not None and (not group or tile.block_k % group == 0):
        return tile
    block_n = 16
    while block_n > 1 and -(-out_features // block_n) < 8 * _NUM_SMS:
        block_n //= 2
    # ~4 KB of weight per tile, at most 32 weights per thread (registers): int4 has twice
    # the weights per byte, so 8 warps
    warps = 8 if fmt == "int4" else 4
    target = int(4096 / _QUANT_BYTES[fmt])
    block_k = max(128, min(4096, target // block_n, 1 << max(in_features - 1, 0).bit_length()))
    if group:
        block_k = max(block_k, group)
    return GemvConfig(block_n, block_k, warps, 3 if in_features > block_k else 1)

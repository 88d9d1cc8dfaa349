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
    bias: bool = False  # the layer adds a bias (Qwen2's qkv)

    def label(self) -> str:
        parts = [f"{self.in_features}x{self.rows}"]
        parts += ["silu"] * self.silu_mul + ["norm"] * self.norm + ["rope_kv"] * self.rope
        parts += ["bias"] * self.bias
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

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

from atom.forward_context import current_fusions


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
    # None: the weight has x's dtype; "float8_e4m3fn": FP8 with one float32 scale per row
    weight_dtype: str | None = None

    def label(self) -> str:
        parts = [f"{self.in_features}x{self.rows}"]
        parts += ["silu"] * self.silu_mul + ["norm"] * self.norm + ["rope_kv"] * self.rope
        parts += ["bias"] * self.bias
        weight = f" {self.weight_dtype} weight" if self.weight_dtype else ""
        return "+".join(parts) + f" {self.dtype}{weight}"


# the SMs of a Hopper GPU: the heuristic aims at several programs per SM
_NUM_SMS = 132


def heuristic_config(
    in_features: int, out_features: int, silu_mul: bool, weight_dtype: str | None = None
) -> GemvConfig:
    """A launch geometry from the shape alone: the largest BLOCK_N that still gives ~8
    programs per SM, and ~8 KB of weight per tile (32 elements per thread of 4 warps); an
    FP8 weight (``weight_dtype``) the FP8 GEMV's heuristic (``quant_heuristic_config``)."""
    rows = out_features // 2 if silu_mul else out_features
    if weight_dtype == "float8_e4m3fn":
        return quant_heuristic_config(in_features, rows, "fp8")
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
    return quant_heuristic_config(in_features, out_features, fmt, group)


def quant_heuristic_config(
    in_features: int, out_features: int, fmt: str, group: int = 0
) -> GemvConfig:
    """``quant_gemv_config``'s heuristic (out_features: the programs' output rows)."""
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


def quant_gemv_candidates(config: GemvConfig, group: int) -> list[tuple[GemvConfig, bool]]:
    """(tile, x loaded once and broadcast) candidates around the heuristic's ``config``, the
    heuristic first with x broadcast (about 2x faster than x in the tile's shape on every
    Llama-3.1-8B layer on the H200: docs/benchmarks.md), then x in the tile's shape, half /
    twice the rows per program (twice / half the chunk: the same bytes per tile), the other
    warp count."""
    half_k = max(config.block_k // 2, group, 128)
    taller = GemvConfig(min(16, config.block_n * 2), half_k, config.num_warps, config.num_stages)
    shorter = GemvConfig(
        max(1, config.block_n // 2), config.block_k * 2, config.num_warps,
        max(2, config.num_stages),
    )  # fmt: skip
    warps = GemvConfig(config.block_n, config.block_k, 12 - config.num_warps, config.num_stages)
    candidates = [(config, True), (config, False), (taller, True), (shorter, True), (warps, True)]
    return list(dict.fromkeys(candidates))


_QUANT_CHOICES: dict = {}


def _variant_label(variant) -> str:
    """ " x_once" for fp8's x-broadcast flag, " waves <w>" for int4's programs per SM."""
    if isinstance(variant, float):
        return f" waves {variant:g}"
    return " x_once" * bool(variant)


def quant_gemv_choices() -> dict[str, str]:
    """The tiles the tuner chose in this process, readable: {"fp8 4096x4096": "..."}."""
    return {
        f"{key[0]} {key[1]}x{key[2]}": f"block_n {config.block_n} block_k {config.block_k} "
        f"warps {config.num_warps} stages {config.num_stages}" + _variant_label(variant)
        for key, (config, variant) in _QUANT_CHOICES.items()
    }


def tuned_quant_gemv(key, candidates: list, device: torch.device, launch: Callable) -> tuple:
    """The fastest of ``candidates`` for ``key`` (a quantized GEMV's format, shape, dtype),
    measured once per process on CUDA: each launched once (compiled), then timed over five
    launches after an L2 flush (CUDA events). Never measured while a CUDA graph is being
    captured (the heuristic's, ``candidates[0]``, then) or with ATOM_QUANT_GEMV_TUNE=0; a
    candidate that fails is skipped."""
    choice = _QUANT_CHOICES.get(key)
    if choice is not None:
        return choice
    if (
        not current_fusions().quant_gemv_tune
        or device.type != "cuda"
        or torch.cuda.is_current_stream_capturing()
        or len(candidates) == 1
    ):
        return candidates[0]
    flush = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best, best_ms = candidates[0], float("inf")
    for candidate in candidates:
        try:
            launch(candidate)
            times = []
            for _ in range(5):
                flush.zero_()
                start.record()
                launch(candidate)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        except Exception:  # noqa: BLE001 (a tile this GPU cannot run: not chosen)
            continue
        ms = sorted(times)[len(times) // 2]
        # another tile must beat the first (the heuristic's) by a margin, not by noise
        if ms < best_ms * 0.97:
            best, best_ms = candidate, ms
    _QUANT_CHOICES[key] = best
    return best

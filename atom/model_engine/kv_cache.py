"""The paged KV cache of the attention layers: one allocation for every layer's K and V.

Layout: ``data`` is ``[2 (K, V), num_layers, num_blocks, block_size, num_kv_heads,
head_dim]``. With ``kv_cache_dtype="fp8"`` it holds ``torch.float8_e4m3fn`` and ``scales``,
``[2, num_layers, num_blocks, block_size, num_kv_heads]`` float32, sits beside it: one scale
per token and kv head (atom/kernels/kv_cache.py says why). Each layer gets views:
``k_cache``/``v_cache`` and, for fp8, ``k_scale``/``v_scale`` (None otherwise).

MLA layers (atom/attention/mla.py, recognised by their ``latent_dim``) keep one latent row
per token instead of K and V: ``data`` is ``[num_layers, num_blocks, block_size,
kv_lora_rank + rope_dim]`` and each layer gets ``latent_cache``. fp8 is not supported there.

DeepSeek-V4 layers (atom/attention/v4.py) keep compressed entries per block and a
per-sequence state (window ring, compressor rows) per state slot; v4.py lays them out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.attention.v4 import allocate_v4_cache, is_v4, v4_block_bytes
from atom.kernels.kv_cache import FP8_DTYPE


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype for ``Config.kv_cache_dtype``: auto = the model's dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be auto or fp8, got {kv_cache_dtype!r}")


def _is_mla(layers) -> bool:
    return hasattr(layers[0], "latent_dim")


def _check_mla_dtype(cache_dtype: torch.dtype) -> None:
    if cache_dtype == FP8_DTYPE:
        raise ValueError(
            "kv_cache_dtype='fp8' is not supported for MLA (latent cache) models; use 'auto'"
        )


def kv_block_bytes(layers, block_size: int, cache_dtype: torch.dtype) -> int:
    """Bytes of one KV block over all layers, scales included."""
    if is_v4(layers):
        return v4_block_bytes(layers, block_size, cache_dtype)
    if _is_mla(layers):  # one latent row per token and layer
        _check_mla_dtype(cache_dtype)
        return sum(a.latent_dim * cache_dtype.itemsize for a in layers) * block_size
    scale_bytes = 4 if cache_dtype == FP8_DTYPE else 0
    per_token = sum(
        2 * a.num_kv_heads * (a.head_dim * cache_dtype.itemsize + scale_bytes) for a in layers
    )
    return per_token * block_size


@dataclass
class KVCache:
    data: torch.Tensor | list[torch.Tensor]  # V4: its pools and state tensors
    scales: torch.Tensor | None  # fp8 only


def allocate_kv_cache(
    layers,
    num_blocks: int,
    block_size: int,
    cache_dtype: torch.dtype,
    device: torch.device,
    num_state_slots: int = 0,
) -> KVCache:
    """Allocate the cache and bind each layer's views (every layer has the same shape)."""
    if is_v4(layers):
        tensors = allocate_v4_cache(
            layers, num_blocks, block_size, num_state_slots, cache_dtype, device
        )
        return KVCache(tensors, None)
    if _is_mla(layers):
        return _allocate_latent_cache(layers, num_blocks, block_size, cache_dtype, device)
    first = layers[0]
    if any((a.num_kv_heads, a.head_dim) != (first.num_kv_heads, first.head_dim) for a in layers):
        raise ValueError("every attention layer must have the same num_kv_heads and head_dim")
    rows = (2, len(layers), num_blocks, block_size, first.num_kv_heads)
    data = torch.empty((*rows, first.head_dim), dtype=cache_dtype, device=device)
    # Rows are read only after they are written; zeroed scales just keep dumps readable.
    scales = (
        torch.zeros(rows, dtype=torch.float32, device=device) if cache_dtype == FP8_DTYPE else None
    )
    for index, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = data[0, index], data[1, index]
        if scales is not None:
            layer.k_scale, layer.v_scale = scales[0, index], scales[1, index]
    return KVCache(data, scales)


def _allocate_latent_cache(layers, num_blocks, block_size, cache_dtype, device) -> KVCache:
    _check_mla_dtype(cache_dtype)
    latent_dim = layers[0].latent_dim
    if any(a.latent_dim != latent_dim for a in layers):
        raise ValueError("every MLA layer must have the same kv_lora_rank + rope dim")
    data = torch.empty(
        (len(layers), num_blocks, block_size, latent_dim), dtype=cache_dtype, device=device
    )
    for index, layer in enumerate(layers):
        layer.latent_cache = data[index]
    return KVCache(data, None)

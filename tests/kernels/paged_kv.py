"""Shared by the attention-kernel tests: a paged KV cache filled with known data."""

import torch

from atom.kernels.kv_cache import quantize_fp8_reference


def make_paged_kv(
    context_lens, num_kv_heads, head_dim, block_size, dtype, device, capacity, seed=0,
    spare_blocks=4,
):  # fmt: skip
    """Random per-sequence K/V written into shuffled blocks of a cache full of garbage
    (`spare_blocks` more blocks than the sequences own).

    Returns (k_cache, v_cache, block_tables, keys, values); keys[b]/values[b] are the dense
    [context_len, num_kv_heads, head_dim] fp32 tensors (rounded through ``dtype``).
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    max_blocks = max(blocks_needed) + 1  # a garbage column past every sequence
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    v_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    # Garbage (but in-bounds) block ids everywhere a sequence does not own the entry.
    block_tables = torch.randint(0, num_blocks, (capacity, max_blocks), generator=generator)
    free = torch.randperm(num_blocks, generator=generator)
    keys, values = [], []
    for b, n in enumerate(context_lens):
        ids, free = free[: blocks_needed[b]], free[blocks_needed[b] :]
        block_tables[b, : len(ids)] = ids
        positions = torch.arange(n)
        slots = ids[positions // block_size] * block_size + positions % block_size
        k = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        k_cache.flatten(0, 1)[slots] = k
        v_cache.flatten(0, 1)[slots] = v
        keys.append(k.float())
        values.append(v.float())
    block_tables = block_tables.to(device, torch.int32)
    return k_cache.to(device), v_cache.to(device), block_tables, keys, values


def quantize_paged_kv(k_cache, v_cache):
    """fp8 copies of whole caches (garbage rows too) with their per-row scales.

    Returns (k_fp8, v_fp8, k_scale, v_scale) as ``store_kvcache`` would have written them.
    """
    k_fp8, k_scale = quantize_fp8_reference(k_cache)
    v_fp8, v_scale = quantize_fp8_reference(v_cache)
    return k_fp8, v_fp8, k_scale, v_scale

"""Writing this step's keys and values into the paged KV cache.

Shapes and dtypes:
    key, value     [num_tokens, num_kv_heads, head_dim], cache dtype; may be strided views
                   (e.g. slices of a fused qkv projection), only head_dim must be unit-stride.
    k_cache,
    v_cache        [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
    slot_mapping   [num_tokens], int32 or int64; slot = block_id * block_size + offset in block,
                   slot == -1 means "padding token, write nothing".

Runtime lengths (never constexpr): num_tokens. Geometry (constexpr): heads, head_dim,
block_size, tile sizes.
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


@triton.jit(do_not_specialize=["num_tokens"])
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_HD: tl.constexpr,  # next_power_of_2(NUM_KV_HEADS * HEAD_DIM)
):
    # Each program copies BLOCK_T tokens; a row holds all heads of one token, flattened.
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_hd = tl.arange(0, BLOCK_HD)
    head = offs_hd // HEAD_DIM
    dim = offs_hd % HEAD_DIM

    slot = tl.load(slot_mapping_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    mask = (slot >= 0)[:, None] & (offs_hd < NUM_KV_HEADS * HEAD_DIM)[None, :]

    token = offs_t.to(tl.int64)[:, None]
    key = tl.load(
        key_ptr + token * stride_key_token + head[None, :] * stride_key_head + dim[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_value_token + head[None, :] * stride_value_head + dim[None, :],
        mask=mask,
    )

    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE
    cache_offs = (
        (block_id * stride_cache_block + block_offset * stride_cache_offset)[:, None]
        + head[None, :] * stride_cache_head
        + dim[None, :]
    )
    tl.store(k_cache_ptr + cache_offs, key, mask=mask)
    tl.store(v_cache_ptr + cache_offs, value, mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` rows into ``k_cache``/``v_cache`` at ``slot_mapping`` (in place).

    Tokens whose slot is -1 are skipped. Runs the Triton kernel on CUDA (or under
    TRITON_INTERPRET=1), the torch reference otherwise.
    """
    if not use_triton(key):
        store_kvcache_reference(key, value, k_cache, v_cache, slot_mapping)
        return
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and k_cache.shape == v_cache.shape
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be unit-stride"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    if num_tokens == 0:
        return
    block_hd = triton.next_power_of_2(num_kv_heads * head_dim)
    # About 4K elements per program: a few tokens for big models, more for small ones.
    block_t = max(1, min(64, 4096 // block_hd))
    grid = (triton.cdiv(num_tokens, block_t),)
    _store_kvcache_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=block_t,
        BLOCK_HD=block_hd,
    )


def store_kvcache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Pure-torch ``store_kvcache``: same shapes, same in-place semantics."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    # Contiguous caches flatten to [num_blocks * block_size, heads, dim] views.
    k_cache.flatten(0, 1)[slots] = key[valid]
    v_cache.flatten(0, 1)[slots] = value[valid]

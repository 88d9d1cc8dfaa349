"""paged_decode_attention: the Triton kernel against its reference, the reference against SDPA."""

import pytest
import torch
import torch.nn.functional as F

from atom.kernels import paged_decode_attention, paged_decode_attention_reference

# fp32 runs the kernel on CUDA when there is one (tf32 dots there), else under
# TRITON_INTERPRET=1 (conftest).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    (torch.float32, DEVICE),
    pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu),
    pytest.param(torch.float16, "cuda", marks=pytest.mark.gpu),
]
TOLERANCE = {
    torch.float32: 1e-5 if DEVICE == "cpu" else 5e-3,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
}


def make_paged_kv(
    context_lens, num_kv_heads, head_dim, block_size, dtype, device, capacity, seed=0
):
    """Random per-sequence K/V written into shuffled blocks of a cache full of garbage.

    Returns (k_cache, v_cache, block_tables, keys, values); keys[b]/values[b] are the dense
    [context_len, num_kv_heads, head_dim] fp32 tensors (rounded through ``dtype``).
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(blocks_needed) + 4
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


CASES = [
    # context_lens (0 = padding row), num_q_heads, num_kv_heads, head_dim, block_size
    ([1], 4, 4, 64, 16),
    ([17, 1, 0, 1100, 64], 2, 2, 64, 16),
    ([33, 0, 1037, 5], 8, 2, 128, 32),  # GQA group 4
    ([300, 129], 16, 2, 64, 16),  # GQA group 8
]


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("context_lens, num_q_heads, num_kv_heads, head_dim, block_size", CASES)
def test_decode_matches_reference(
    context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, num_splits
):
    batch = len(context_lens)
    k_cache, v_cache, block_tables, _, _ = make_paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, dtype, device, capacity=batch + 2
    )
    q = torch.randn(batch, num_q_heads, head_dim, generator=torch.Generator().manual_seed(1))
    q = q.to(device, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5

    expected = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, lens, scale)
    out = torch.full_like(q, float("nan"))  # every element must be written
    result = paged_decode_attention(
        q, k_cache, v_cache, block_tables, lens, scale, out=out, num_splits=num_splits
    )
    assert result is out and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    padding = lens == 0
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))


@pytest.mark.parametrize("context_lens, num_q_heads, num_kv_heads, head_dim, block_size", CASES)
def test_decode_reference_matches_dense_sdpa(
    context_lens, num_q_heads, num_kv_heads, head_dim, block_size
):
    batch = len(context_lens)
    k_cache, v_cache, block_tables, keys, values = make_paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, torch.float32, "cpu", capacity=batch
    )
    q = torch.randn(batch, num_q_heads, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = 0.1
    out = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, lens, scale)
    group = num_q_heads // num_kv_heads
    for b, n in enumerate(context_lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        k = keys[b].transpose(0, 1).repeat_interleave(group, dim=0)  # [q_heads, n, dim]
        v = values[b].transpose(0, 1).repeat_interleave(group, dim=0)
        dense = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=scale).squeeze(1)
        torch.testing.assert_close(out[b], dense, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_decode_replays_in_cuda_graph_with_new_lengths():
    num_q_heads, num_kv_heads, head_dim, block_size = 8, 2, 128, 16
    context_lens = [2000, 700, 1, 40]
    k_cache, v_cache, block_tables, _, _ = make_paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, torch.bfloat16, "cuda", capacity=4
    )
    q = torch.randn(4, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    args = (q, k_cache, v_cache, block_tables, lens, head_dim**-0.5)
    paged_decode_attention(*args, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, out=out)
    for new_lens in ([2000, 700, 1, 40], [5, 0, 1, 33], [1999, 1, 0, 0]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.normal_()
        graph.replay()
        expected = paged_decode_attention_reference(*args)
        torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)

"""MLA kernels: the latent write and the paged latent decode against their references,
and the decode reference against dense attention over the sequence's rows."""

import pytest
import torch

from atom.kernels.mla import (
    paged_mla_decode,
    paged_mla_decode_reference,
    store_latent_cache,
    store_latent_cache_reference,
)

# fp32 runs the kernels on CUDA when there is one (tf32 dots there), else under
# TRITON_INTERPRET=1 (conftest).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    (torch.float32, DEVICE),
    pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu),
]
TOLERANCE = {torch.float32: 1e-5 if DEVICE == "cpu" else 5e-3, torch.bfloat16: 3e-2}


def _paged_latent(context_lens, latent_dim, block_size, dtype, device, capacity, seed=0):
    """Random rows per sequence in shuffled blocks of a cache full of garbage."""
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 3
    cache = torch.randn(num_blocks, block_size, latent_dim, generator=generator).to(dtype)
    tables = torch.randint(0, num_blocks, (capacity, max(needed) + 1), generator=generator)
    free = torch.randperm(num_blocks, generator=generator)
    rows = []
    for b, n in enumerate(context_lens):
        ids, free = free[: needed[b]], free[needed[b] :]
        tables[b, : len(ids)] = ids
        positions = torch.arange(n)
        slots = ids[positions // block_size] * block_size + positions % block_size
        values = torch.randn(n, latent_dim, generator=generator).to(dtype)
        cache.flatten(0, 1)[slots] = values
        rows.append(values.float())
    return cache.to(device), tables.to(device, torch.int32), rows


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("num_tokens, latent_dim", [(1, 24), (37, 24), (70, 576)])
def test_store_latent_matches_reference(num_tokens, latent_dim, dtype, device):
    generator = torch.Generator().manual_seed(num_tokens)
    num_blocks, block_size = 8, 16
    # a strided source (a slice of a wider projection), as the model passes it
    wide = torch.randn(num_tokens, latent_dim + 8, generator=generator).to(device, dtype)
    latent = wide[:, :latent_dim]
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::5] = -1
    slots = slots.to(device)
    cache = torch.randn(num_blocks, block_size, latent_dim, generator=generator).to(device, dtype)
    expected = cache.clone()
    store_latent_cache_reference(latent, expected, slots)
    store_latent_cache(latent, cache, slots)
    assert torch.equal(cache, expected)
    kept = slots >= 0
    assert torch.equal(cache.view(-1, latent_dim)[slots[kept]], latent[kept])


CASES = [
    # context_lens (0 = padding row), num_heads, kv_lora_rank, rope_dim, block_size
    ([1], 4, 16, 8, 16),
    ([17, 0, 40, 1], 4, 16, 8, 16),
    ([33, 70], 20, 64, 32, 32),  # two head blocks, the second partial
]


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("context_lens, num_heads, rank, rope_dim, block_size", CASES)
def test_mla_decode_matches_reference(
    context_lens, num_heads, rank, rope_dim, block_size, dtype, device
):
    batch = len(context_lens)
    cache, tables, rows = _paged_latent(
        context_lens, rank + rope_dim, block_size, dtype, device, capacity=batch + 2
    )
    generator = torch.Generator().manual_seed(1)
    q_latent = torch.randn(batch, num_heads, rank, generator=generator).to(device, dtype)
    q_rope = torch.randn(batch, num_heads, rope_dim, generator=generator).to(device, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = 0.125
    out = paged_mla_decode(q_latent, q_rope, cache, tables, lens, scale)
    expected = paged_mla_decode_reference(q_latent, q_rope, cache, tables, lens, scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)
    # the reference against dense attention over each sequence's own rows
    for b, n in enumerate(context_lens):
        if n == 0:
            assert torch.all(expected[b] == 0)
            continue
        latent, k_rope = rows[b][:, :rank], rows[b][:, rank:]
        scores = (q_latent[b].float().cpu() @ latent.T + q_rope[b].float().cpu() @ k_rope.T) * scale
        dense = torch.softmax(scores, dim=-1) @ latent
        torch.testing.assert_close(expected[b].float().cpu(), dense, atol=TOLERANCE[dtype], rtol=0)

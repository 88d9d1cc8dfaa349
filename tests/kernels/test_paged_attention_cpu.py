"""The batched CPU attention (one SDPA per layer) against the per-sequence torch references:
varied lengths, shuffled block tables, GQA, padding rows, fp8 caches, NaN garbage in every
cache slot no sequence owns, prefill with prefixes and groups split by the size budget."""

import pytest
import torch

from atom.kernels import (
    paged_attention_cpu,
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
)
from atom.kernels.paged_attention_cpu import (
    decode_attention_cpu,
    decode_plan,
    prefill_attention_cpu,
    prefill_plans,
)
from tests.kernels.paged_kv import make_paged_kv, quantize_paged_kv

DECODE_CASES = [
    # context_lens (0 = padding row), num_q_heads, num_kv_heads, head_dim, block_size
    ([1], 4, 4, 64, 16),
    ([17, 1, 0, 1100, 64], 2, 2, 64, 16),
    ([33, 0, 1037, 5], 8, 2, 128, 32),  # GQA group 4
    ([300, 129, 16, 15, 17], 9, 3, 64, 16),  # SmolLM2's heads
    ([145, 145, 145], 9, 3, 64, 16),  # one length: the plan has no mask
]


def poison_unowned(cache, block_tables, context_lens, block_size):
    """NaN in every slot past each sequence's context (the engine's cache is torch.empty)."""
    owned = torch.zeros(cache.shape[0] * block_size, dtype=torch.bool)
    for b, n in enumerate(context_lens):
        positions = torch.arange(n)
        blocks = block_tables[b, positions // block_size].long()
        owned[blocks * block_size + positions % block_size] = True
    flat = cache.flatten(0, 1)
    flat[~owned] = float("nan")
    return cache


def paged(context_lens, num_kv_heads, head_dim, block_size, kv_cache_dtype):
    k_cache, v_cache, block_tables, _, _ = make_paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, torch.float32, "cpu",
        capacity=len(context_lens) + 2,
    )  # fmt: skip
    scales = {}
    if kv_cache_dtype == "fp8":
        k_cache, v_cache, k_scale, v_scale = quantize_paged_kv(k_cache, v_cache)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        for s in (k_scale, v_scale):  # NaN scales stand in for garbage fp8 rows
            poison_unowned(s.unsqueeze(-1), block_tables, context_lens, block_size)
    else:
        for cache in (k_cache, v_cache):
            poison_unowned(cache, block_tables, context_lens, block_size)
    return k_cache, v_cache, block_tables, scales


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize(
    "context_lens, num_q_heads, num_kv_heads, head_dim, block_size", DECODE_CASES
)
def test_decode_matches_per_sequence_reference(
    context_lens, num_q_heads, num_kv_heads, head_dim, block_size, kv_cache_dtype
):
    k_cache, v_cache, block_tables, scales = paged(
        context_lens, num_kv_heads, head_dim, block_size, kv_cache_dtype
    )
    batch = len(context_lens)
    q = torch.randn(batch, num_q_heads, head_dim, generator=torch.Generator().manual_seed(1))
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    expected = paged_decode_attention_reference(
        q, k_cache, v_cache, block_tables, lens, scale, **scales
    )
    num_slots = k_cache.shape[0] * block_size
    plan = decode_plan(block_tables, lens, batch, block_size, num_slots)
    out = decode_attention_cpu(
        q, k_cache, v_cache, plan, scale, k_scale=scales.get("k_scale"),
        v_scale=scales.get("v_scale"),
    )  # fmt: skip
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    padding = lens == 0
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))


PREFILL_CASES = [
    # (q_len, context_len) per sequence, num_q_heads, num_kv_heads, head_dim, block_size
    ([(5, 5)], 4, 4, 64, 16),
    ([(17, 17), (1, 40), (0, 9), (33, 100), (16, 16)], 8, 2, 64, 16),  # prefixes, empty
    ([(128, 128), (3, 131), (1, 1)], 9, 3, 64, 16),  # SmolLM2's heads, a decode row
    ([(40, 300), (7, 7)], 16, 2, 128, 32),  # GQA group 8
]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("budget", [paged_attention_cpu.MAX_PADDED_SCORES, 4096])
@pytest.mark.parametrize("seqs, num_q_heads, num_kv_heads, head_dim, block_size", PREFILL_CASES)
def test_prefill_matches_per_sequence_reference(
    seqs, num_q_heads, num_kv_heads, head_dim, block_size, budget, kv_cache_dtype, monkeypatch
):
    """`budget` 4096 splits the step into several groups and sends the longest sequences
    to the per-sequence reference: every way a step can be cut gives the same rows."""
    monkeypatch.setattr(paged_attention_cpu, "MAX_PADDED_SCORES", budget)
    context_lens = [n for _, n in seqs]
    k_cache, v_cache, block_tables, scales = paged(
        context_lens, num_kv_heads, head_dim, block_size, kv_cache_dtype
    )
    q_lens = [q for q, _ in seqs]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_q_heads, head_dim, generator=torch.Generator().manual_seed(2))
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    args = (q, k_cache, v_cache, block_tables, cu, lens, scale)
    expected = paged_prefill_attention_reference(*args, max(q_lens), **scales)
    num_slots = k_cache.shape[0] * block_size
    plans = prefill_plans(block_tables, cu, lens, block_size, num_slots, num_q_heads)
    if budget == 4096 and len(seqs) > 2:
        assert len(plans) > 1  # the small budget did cut the step
    out = prefill_attention_cpu(
        q, k_cache, v_cache, plans, block_tables, cu, lens, scale,
        k_scale=scales.get("k_scale"), v_scale=scales.get("v_scale"),
    )  # fmt: skip
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_plan_masks_only_unequal_lengths():
    """No mask where every row has the same length (SDPA without one is faster), one where
    lengths differ or a padding row is present."""
    block_tables = torch.arange(12, dtype=torch.int32).view(3, 4)
    for lens, masked in (([40, 40, 40], False), ([40, 39, 40], True), ([40, 0, 40], True)):
        lens = torch.tensor(lens, dtype=torch.int32)
        plan = decode_plan(block_tables, lens, 3, 16, 12 * 16)
        assert (plan.mask is not None) == masked

"""paged_prefill_attention: the Triton kernel against its reference, the reference against SDPA."""

import pytest
import torch
import torch.nn.functional as F

from atom.kernels import paged_prefill_attention, paged_prefill_attention_reference
from tests.kernels.paged_kv import make_paged_kv, quantize_paged_kv

# fp32 runs the kernel on CUDA when there is one (tf32 dots there), else under
# TRITON_INTERPRET=1 (conftest).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    (torch.float32, DEVICE),
    pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu),
    pytest.param(torch.float16, "cuda", marks=pytest.mark.gpu),
]
TOLERANCE = {
    torch.float32: 2e-5 if DEVICE == "cpu" else 5e-3,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
}


def make_queries(q_lens, num_q_heads, head_dim, dtype, device, fused):
    """Packed queries [sum(q_lens), num_q_heads, head_dim]; a strided qkv view when fused."""
    total = sum(q_lens)
    generator = torch.Generator().manual_seed(1)
    if fused:
        qkv = torch.randn(total, 2 * num_q_heads, head_dim, generator=generator)
        return qkv.to(device, dtype)[:, :num_q_heads]
    return torch.randn(total, num_q_heads, head_dim, generator=generator).to(device, dtype)


CASES = {
    # [(q_len, context_len)], num_q_heads, num_kv_heads, head_dim, block_size, fused q
    "full_prefill": ([(1, 1), (37, 37), (1030, 1030)], 2, 2, 64, 16, False),
    "chunked_prefill_gqa4": ([(100, 300), (50, 50), (16, 48)], 8, 2, 128, 32, True),
    "mixed_with_decode_rows": (
        [(70, 70), (1, 33), (20, 129), (1, 1), (1, 600)],
        4,
        1,
        64,
        16,
        False,
    ),
}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_prefill_matches_reference(case, dtype, device, kv_cache_dtype):
    seqs, num_q_heads, num_kv_heads, head_dim, block_size, fused = CASES[case]
    q_lens = [q_len for q_len, _ in seqs]
    context_lens = [n for _, n in seqs]
    k_cache, v_cache, block_tables, _, _ = make_paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, dtype, device, capacity=len(seqs) + 1
    )
    q = make_queries(q_lens, num_q_heads, head_dim, dtype, device, fused)
    cu_seqlens = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    kv_scales = {}
    if kv_cache_dtype == "fp8":
        k_cache, v_cache, k_scale, v_scale = quantize_paged_kv(k_cache, v_cache)
        kv_scales = dict(k_scale=k_scale, v_scale=v_scale)
    args = (q, k_cache, v_cache, block_tables, cu_seqlens, lens, scale)

    expected = paged_prefill_attention_reference(*args, **kv_scales)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    # A generous max_seqlen_q: programs past a sequence's queries must write nothing.
    result = paged_prefill_attention(*args, max(q_lens) + 70, out=out, **kv_scales)
    assert result is out
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CASES)
def test_prefill_reference_matches_dense_sdpa(case):
    seqs, num_q_heads, num_kv_heads, head_dim, block_size, _ = CASES[case]
    q_lens = [q_len for q_len, _ in seqs]
    context_lens = [n for _, n in seqs]
    k_cache, v_cache, block_tables, keys, values = make_paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, torch.float32, "cpu", capacity=len(seqs)
    )
    q = make_queries(q_lens, num_q_heads, head_dim, torch.float32, "cpu", fused=False)
    cu_seqlens = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = 0.1
    out = paged_prefill_attention_reference(
        q, k_cache, v_cache, block_tables, cu_seqlens, lens, scale, max(q_lens)
    )
    group = num_q_heads // num_kv_heads
    for b, (q_len, n) in enumerate(seqs):
        start = int(cu_seqlens[b])
        q_b = q[start : start + q_len].transpose(0, 1)  # [q_heads, q_len, dim]
        k = keys[b].transpose(0, 1).repeat_interleave(group, dim=0)  # [q_heads, n, dim]
        v = values[b].transpose(0, 1).repeat_interleave(group, dim=0)
        # Query i sits at position n - q_len + i: bottom-right aligned causal mask.
        allowed = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
        dense = F.scaled_dot_product_attention(q_b, k, v, attn_mask=allowed, scale=scale)
        torch.testing.assert_close(
            out[start : start + q_len], dense.transpose(0, 1), atol=1e-5, rtol=1e-5
        )

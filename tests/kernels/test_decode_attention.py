"""paged_decode_attention: the Triton kernel against its reference, the reference against SDPA."""

import pytest
import torch
import torch.nn.functional as F

from atom.kernels import paged_decode_attention, paged_decode_attention_reference
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
    torch.float32: 1e-5 if DEVICE == "cpu" else 5e-3,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
}


CASES = [
    # context_lens (0 = padding row), num_q_heads, num_kv_heads, head_dim, block_size
    ([1], 4, 4, 64, 16),
    ([17, 1, 0, 1100, 64], 2, 2, 64, 16),
    ([33, 0, 1037, 5], 8, 2, 128, 32),  # GQA group 4
    ([300, 129], 16, 2, 64, 16),  # GQA group 8
]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("context_lens, num_q_heads, num_kv_heads, head_dim, block_size", CASES)
def test_decode_matches_reference(
    context_lens,
    num_q_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    device,
    num_splits,
    kv_cache_dtype,
):
    check_decode(
        context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device,
        num_splits, kv_cache_dtype,
    )  # fmt: skip


def check_decode(
    context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device,
    num_splits, kv_cache_dtype, **options,
):  # fmt: skip
    """The kernel (``options``: paged_decode_attention's) against the reference; padding
    rows give zeros."""
    batch = len(context_lens)
    k_cache, v_cache, block_tables, _, _ = make_paged_kv(
        context_lens, num_kv_heads, head_dim, block_size, dtype, device, capacity=batch + 2
    )
    q = torch.randn(batch, num_q_heads, head_dim, generator=torch.Generator().manual_seed(1))
    q = q.to(device, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    kv_scales = {}
    if kv_cache_dtype == "fp8":
        k_cache, v_cache, k_scale, v_scale = quantize_paged_kv(k_cache, v_cache)
        kv_scales = dict(k_scale=k_scale, v_scale=v_scale)
    args = (q, k_cache, v_cache, block_tables, lens, scale)

    expected = paged_decode_attention_reference(*args, **kv_scales)
    out = torch.full_like(q, float("nan"))  # every element must be written
    result = paged_decode_attention(*args, out=out, num_splits=num_splits, **kv_scales, **options)
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


def test_decode_reference_reads_fp8_cache_as_dequantized_rows():
    """The fp8 reference equals the fp32 reference over the dequantized cache."""
    context_lens = [40, 0, 17]
    k_cache, v_cache, block_tables, _, _ = make_paged_kv(
        context_lens, 2, 64, 16, torch.float32, "cpu", capacity=3
    )
    k_fp8, v_fp8, k_scale, v_scale = quantize_paged_kv(k_cache, v_cache)
    q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(2))
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = paged_decode_attention_reference(
        q, k_fp8, v_fp8, block_tables, lens, 0.125, k_scale=k_scale, v_scale=v_scale
    )
    k_dequantized = k_fp8.float() * k_scale[..., None]
    v_dequantized = v_fp8.float() * v_scale[..., None]
    expected = paged_decode_attention_reference(
        q, k_dequantized, v_dequantized, block_tables, lens, 0.125
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # and quantization moved the result a little, not a lot
    exact = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, lens, 0.125)
    assert 0 < (out - exact).abs().max() < 0.05


# The launch knobs and split options (benchmarks/decode_attention_sweep.py): each gives the
# reference's output. Contexts: a padding row (0), rows whose only non-empty split is split
# 0 (1, 17, 64: one tile of 64 per split), rows over several splits (129, 300).
OPTION_LENS = [17, 0, 300, 1, 129, 64]
OPTIONS = {
    "tile32_cap64": dict(block_n=32, max_splits=64),
    "tile128_cap16_warps2_stages1": dict(block_n=128, max_splits=16, num_warps=2, num_stages=1),
    "tile64_warps8_stages4_cap128": dict(block_n=64, num_warps=8, num_stages=4, max_splits=128),
    "min100": dict(min_split_tokens=100),
    "skip": dict(skip_empty_splits=True),
    "min200_skip": dict(min_split_tokens=200, skip_empty_splits=True),
    "direct": dict(single_split_direct=True),
    "tile64_min256_skip_direct": dict(
        block_n=64, min_split_tokens=256, skip_empty_splits=True, single_split_direct=True
    ),
}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
def test_decode_options_match_reference(options, dtype, device, num_splits, kv_cache_dtype):
    """Every knob and split option, split (5: most rows leave splits empty) and not (1, and
    the interpreter's pick), bf16 / fp16 (GPU) and fp32, bf16 or fp8 cache: the reference's
    output, zeros for the padding row, every element written."""
    check_decode(OPTION_LENS, 8, 2, 64, 16, dtype, device, num_splits, kv_cache_dtype, **options)


@pytest.mark.parametrize("dtype, device", DTYPES)
@pytest.mark.parametrize("min_split_tokens", [0, 64, 1000])
def test_decode_only_split_zero_has_tokens(dtype, device, min_split_tokens):
    """Contexts whose only non-empty split is split 0 (with 8 splits and 64-token tiles:
    up to 64 tokens, or up to min_split_tokens): with ``single_split_direct`` that program
    writes ``out`` and the merge skips the row; beside a row over several splits and
    padding rows, with and without skipping empty splits."""
    lens = [64, 1, 0, 700, 63, 0, 2]
    for skip in (False, True):
        check_decode(
            lens, 4, 2, 64, 16, dtype, device, 8, "auto", block_n=64,
            min_split_tokens=min_split_tokens, skip_empty_splits=skip, single_split_direct=True,
        )  # fmt: skip


def test_decode_split_cap_is_checked():
    """The split cap is the merge kernel's tile: a power of 2 no smaller than the split count."""
    k_cache, v_cache, block_tables, _, _ = make_paged_kv(
        [5], 1, 64, 16, torch.float32, DEVICE, capacity=1
    )
    q = torch.randn(1, 1, 64, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, block_tables, lens, 0.125)
    with pytest.raises(AssertionError, match="power of 2"):
        paged_decode_attention(*args, max_splits=48)
    with pytest.raises(AssertionError, match="num_splits"):
        paged_decode_attention(*args, num_splits=32, max_splits=16)

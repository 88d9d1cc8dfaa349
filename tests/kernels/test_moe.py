"""fused_moe (Triton, atom/kernels/moe.py) against its torch reference.

On CPU the kernels run under TRITON_INTERPRET=1 (conftest) on tiny shapes in fp32/fp16; on
CUDA bf16 at DeepSeek-V2-Lite's expert shape, under CUDA-graph capture and replay, and with
host syncs turned into errors. At up to ``moe.DECODE_GEMV_MAX_PAIRS`` pairs (and no tiles
given) fused_moe runs the per-pair GEMV instead of align + grouped GEMMs: both paths side by
side in test_moe_gemv.py.
"""

import pytest
import torch

from atom.kernels import moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ids(num_tokens, num_experts, top_k, generator, skew=False):
    """Distinct experts per token; ``skew``: most tokens pick among the first few experts
    (some get many pairs, others none)."""
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    if skew:
        scores[:, : top_k + 1] += 1.0
    return scores.topk(top_k, dim=-1).indices


def _inputs(num_tokens, num_experts, top_k, hidden, intermediate, dtype, seed, skew=False):
    generator = torch.Generator().manual_seed(seed)
    ids = _ids(num_tokens, num_experts, top_k, generator, skew)
    weights = torch.rand(num_tokens, top_k, generator=generator)
    x = torch.randn(num_tokens, hidden, generator=generator)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator)
    down = torch.randn(num_experts, hidden, intermediate, generator=generator)
    scale_gate_up, scale_down = hidden**-0.5, intermediate**-0.5
    return (
        x.to(DEVICE, dtype),
        weights.to(DEVICE),
        ids.to(DEVICE),
        (scale_gate_up * gate_up).to(DEVICE, dtype),
        (scale_down * down).to(DEVICE, dtype),
    )


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, block_m, skew",
    [
        (1, 8, 2, 16, False),
        (37, 6, 3, 16, True),
        (64, 8, 1, 32, False),
        (0, 4, 2, 16, False),
        (1, 64, 10, 16, False),  # Qwen3-Next's decode benchmark
        (1, 512, 10, 16, False),  # Qwen3-Next: the fill past the used rows takes two steps
        (40, 512, 10, 16, False),  # more used blocks (~290) than one step's (32)
    ],
)
def test_align_matches_reference_and_groups_pairs_by_expert(
    num_tokens, num_experts, top_k, block_m, skew
):
    ids = _ids(num_tokens, num_experts, top_k, torch.Generator().manual_seed(1), skew)
    ids = ids.to(DEVICE)
    sorted_pairs, block_experts, num_padded = moe.moe_align(ids, num_experts, block_m)
    expected = moe.moe_align_reference(ids, num_experts, block_m)
    for got, want in zip((sorted_pairs, block_experts, num_padded), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # independent of the reference: each pair once, in a block of its expert, token order
    num_pairs = ids.numel()
    rows, blocks = moe.moe_align_size(num_pairs, num_experts, block_m)
    assert sorted_pairs.shape == (rows,) and block_experts.shape == (blocks,)
    used = int(num_padded)
    assert used % block_m == 0 and used <= rows
    pairs = sorted_pairs[:used].cpu()
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    assert (sorted_pairs[used:] == num_pairs).all()
    flat = ids.reshape(-1).cpu()
    owner = block_experts.cpu().repeat_interleave(block_m)[:used]
    assert torch.equal(flat[real], owner[pairs < num_pairs])
    assert (block_experts[used // block_m :] == -1).all()
    for expert in range(num_experts):
        mine = real[flat[real] == expert]
        assert torch.equal(mine, mine.sort().values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("swiglu_limit", [None, 0.5])
@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, hidden, intermediate, skew",
    [
        (1, 8, 2, 64, 32, False),
        (33, 6, 3, 48, 40, True),  # not powers of 2; one expert gets several blocks
        (5, 4, 1, 64, 32, False),  # top-1: no sum over k
    ],
)
def test_fused_moe_matches_reference(
    num_tokens, num_experts, top_k, hidden, intermediate, skew, swiglu_limit, dtype
):
    args = _inputs(num_tokens, num_experts, top_k, hidden, intermediate, dtype, 2, skew)
    x_before = args[0].clone()
    out = moe.fused_moe(*args, swiglu_limit)
    expected = moe.routed_experts_reference(*args, swiglu_limit)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(args[0], x_before, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weight_before_down_matches_a_per_pair_loop(dtype):
    """DeepSeek-V4.1's order: each pair's activation times its routing weight (rounded to
    x's dtype) goes into the down GEMM. Triton and the reference against a hand loop; in
    fp16 the rounding differs from the weight applied after the down GEMM."""
    args = _inputs(21, 6, 3, 48, 40, dtype, 5, skew=True)
    x, weights, ids, gate_up, down = args
    expected = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            act = moe.swiglu_reference(x[t] @ gate_up[e].T, 0.5)
            expected[t] += (down[e] @ (act * weights[t, j]).to(dtype)).float()
    reference = moe.routed_experts_reference(*args, 0.5, weight_before_down=True)
    fused = moe.fused_moe(*args, 0.5, weight_before_down=True)
    tolerance = 1e-5 if dtype == torch.float32 else 4e-3
    for out in (reference, fused):
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    if dtype == torch.float16:
        after = moe.routed_experts_reference(*args, 0.5)
        assert not torch.equal(after, reference)


def test_fused_moe_tiles_and_no_tokens():
    args = _inputs(9, 8, 2, 64, 32, torch.float32, 3)
    expected = moe.routed_experts_reference(*args)
    for tiles in (moe.MoeTiles(16, 16, 16), moe.MoeTiles(32, 64, 32)):
        torch.testing.assert_close(moe.fused_moe(*args, tiles=tiles), expected)
    empty = [a[:0] for a in args[:3]] + list(args[3:])
    assert moe.fused_moe(*empty).shape == (0, 64)


# -- on the GPU ----------------------------------------------------------------------------------

LITE = dict(num_experts=64, top_k=6, hidden=2048, intermediate=1408)  # DeepSeek-V2-Lite


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
@pytest.mark.parametrize("swiglu_limit", [None, 10.0])
def test_fused_moe_bf16_cuda(num_tokens, swiglu_limit):
    args = _inputs(num_tokens, **LITE, dtype=torch.bfloat16, seed=4, skew=num_tokens == 1000)
    out = moe.fused_moe(*args, swiglu_limit)
    expected = moe.routed_experts_reference(*args, swiglu_limit)
    # the kernel sums the k contributions in fp32 (HF: in bf16): a few bf16 ulps
    scale = expected.abs().max()
    assert (out.float() - expected.float()).abs().max() <= 2e-2 * scale


@pytest.mark.gpu
def test_fused_moe_is_graph_capturable_without_host_sync():
    """Captured once, replayed with new routing: same result as eager on that routing; and
    eager calls make no host sync (sync debug mode turns one into an error)."""
    num_tokens = 16
    x, weights, ids, gate_up, down = _inputs(num_tokens, **LITE, dtype=torch.bfloat16, seed=5)
    moe.fused_moe(x, weights, ids, gate_up, down)  # compile (warm-up) outside capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe.fused_moe(x, weights, ids, gate_up, down)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, weights, ids, gate_up, down)
    generator = torch.Generator().manual_seed(6)
    for skew in (False, True):
        new_ids = _ids(num_tokens, LITE["num_experts"], LITE["top_k"], generator, skew)
        ids.copy_(new_ids)
        weights.copy_(torch.rand(weights.shape, generator=generator))
        x.copy_(torch.randn(x.shape, generator=generator))
        graph.replay()
        torch.testing.assert_close(out, moe.fused_moe(x, weights, ids, gate_up, down))

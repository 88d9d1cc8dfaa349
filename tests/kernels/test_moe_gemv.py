"""fused_moe's decode path (one GEMV per (token, k) pair, atom/kernels/moe_gemv.py) against
the torch reference and against the grouped GEMMs (atom/kernels/moe.py), and the rule that
picks between them.

On CPU the kernels run under TRITON_INTERPRET=1 on tiny shapes: fp32 and fp16 against both
(the grouped GEMMs' tl.dot gives wrong bf16 results under the interpreter, so bf16 is
compared with the reference only); on CUDA bf16 at Qwen3-Next's and DeepSeek-V4's shapes.
"""

import pytest
import torch

from atom.kernels import moe, moe_gemv
from atom.kernels.moe_combine import moe_combine_reference
from tests.kernels.test_moe import DEVICE, _inputs

# (tokens, experts, top_k, hidden, intermediate, skew)
CASES = [
    (1, 8, 2, 64, 32, False),  # decode
    (3, 6, 1, 48, 40, False),  # top-1, not powers of 2
    (4, 4, 3, 64, 32, True),  # 12 pairs on 4 experts: every expert chosen by several tokens
]


def _fused(monkeypatch, gemv: bool, *args, **kwargs) -> torch.Tensor:
    monkeypatch.setattr(moe, "DECODE_GEMV_OVERRIDE", gemv)
    return moe.fused_moe(*args, **kwargs)


def _tolerance(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weight_before_down", [False, True])
@pytest.mark.parametrize("swiglu_limit", [None, 0.5])
@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden, intermediate, skew", CASES)
def test_gemv_matches_reference_and_grouped_gemms(
    monkeypatch,
    num_tokens,
    num_experts,
    top_k,
    hidden,
    intermediate,
    skew,
    swiglu_limit,
    weight_before_down,
    dtype,
):
    args = _inputs(num_tokens, num_experts, top_k, hidden, intermediate, dtype, 2, skew)
    x_before = args[0].clone()
    options = dict(swiglu_limit=swiglu_limit, weight_before_down=weight_before_down)
    out = _fused(monkeypatch, True, *args, **options)
    grouped = _fused(monkeypatch, False, *args, **options)
    expected = moe.routed_experts_reference(*args, **options)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    torch.testing.assert_close(out, expected, **_tolerance(dtype))
    torch.testing.assert_close(out, grouped, **_tolerance(dtype))
    torch.testing.assert_close(args[0], x_before, rtol=0, atol=0)


@pytest.mark.parametrize("weight_before_down", [False, True])
@pytest.mark.parametrize("swiglu_limit", [None, 0.5])
def test_gemv_bf16_matches_reference(monkeypatch, swiglu_limit, weight_before_down):
    """bf16 against the reference, which sums over k in bf16 (the kernel in fp32): a few
    bf16 ulps of the largest output. The interpreter truncates fp32 to bf16 where the GPU
    rounds, at each of the kernels' five rounding points (GEMV outputs, SiLU, products),
    hence 5e-2 here (the GPU test: 2e-2)."""
    args = _inputs(2, 8, 3, 64, 32, torch.bfloat16, 3)
    options = dict(swiglu_limit=swiglu_limit, weight_before_down=weight_before_down)
    out = _fused(monkeypatch, True, *args, **options)
    expected = moe.routed_experts_reference(*args, **options)
    assert out.dtype == torch.bfloat16
    scale = expected.float().abs().max()
    assert (out.float() - expected.float()).abs().max() <= 5e-2 * scale


def _integer_inputs(ids: list[list[int]], num_experts: int, hidden=64, intermediate=32):
    """Integer-valued fp32 inputs whose every sum is exact in any order: gate >= 64 (so
    SiLU(gate) == gate in fp32: exp(-gate) < half an ulp of 1), |up| <= 128, integer
    down weights and power-of-two routing weights; every value stays below 2^24."""
    generator = torch.Generator().manual_seed(7)
    topk_ids = torch.tensor(ids)
    weights = torch.tensor([0.5, 0.25, 1.0, 2.0])[torch.arange(topk_ids.numel()) % 4]
    x = torch.randint(1, 3, (len(ids), hidden), generator=generator).float()
    gate = torch.randint(1, 3, (num_experts, intermediate, hidden), generator=generator)
    up = torch.randint(-1, 2, (num_experts, intermediate, hidden), generator=generator)
    down = torch.randint(-1, 2, (num_experts, hidden, intermediate), generator=generator)
    gate_up = torch.cat([gate, up], dim=1).float()
    args = (x, weights.view(topk_ids.shape), topk_ids, gate_up, down.float())
    return [t.to(DEVICE) for t in args]


@pytest.mark.parametrize("weight_before_down", [False, True])
@pytest.mark.parametrize("swiglu_limit", [None, 50.0])
@pytest.mark.parametrize(
    "ids",
    [
        [[0, 3], [3, 0], [3, 5]],  # every token shares an expert with another
        [[2], [2], [1]],  # top-1: the per-pair rows are the output
    ],
)
def test_gemv_exact_in_fp32(monkeypatch, ids, swiglu_limit, weight_before_down):
    """Where every sum is exact, the GEMV path, the grouped GEMMs and the reference agree
    to the bit: the same rounding points, and no other difference."""
    args = _integer_inputs(ids, num_experts=6)
    options = dict(swiglu_limit=swiglu_limit, weight_before_down=weight_before_down)
    out = _fused(monkeypatch, True, *args, **options)
    assert torch.equal(out, _fused(monkeypatch, False, *args, **options))
    assert torch.equal(out, moe.routed_experts_reference(*args, **options))
    if swiglu_limit is not None:  # the clamp was reached
        assert not torch.equal(out, moe.routed_experts_reference(*args, weight_before_down))


@pytest.mark.parametrize("gated", [True, False])
def test_gemv_with_shared_expert(monkeypatch, gated):
    """The shared expert's epilogue (moe_combine) after the GEMV path, as after the grouped
    GEMMs: against the reference's ops."""
    args = _inputs(3, 8, 2, 64, 32, torch.float32, 4)
    generator = torch.Generator().manual_seed(5)
    shared = torch.randn(3, 64, generator=generator).to(DEVICE)
    gate = (torch.randn(1, 64, generator=generator) / 8).to(DEVICE) if gated else None
    out = _fused(monkeypatch, True, *args, shared=shared, shared_gate=gate)
    routed = moe.routed_experts_reference(*args)
    expected = moe_combine_reference(routed[:, None], shared, args[0], gate)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grouped = _fused(monkeypatch, False, *args, shared=shared, shared_gate=gate)
    torch.testing.assert_close(out, grouped, rtol=1e-5, atol=1e-5)


def _shared_expert(hidden, intermediate, dtype, seed, limit=None, weight_before_down=False):
    """A shared expert with a routed expert's math (SwiGLU, the same clamp) and its own
    weights; its forward is the reference's expert 0 with weight 1 (what the models run)."""
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(1, 2 * intermediate, hidden, generator=generator) * hidden**-0.5
    down = torch.randn(1, hidden, intermediate, generator=generator) * intermediate**-0.5
    gate_up, down = gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype)

    def forward(x):
        ids = torch.zeros(x.shape[0], 1, dtype=torch.long, device=x.device)
        ones = torch.ones(x.shape[0], 1, device=x.device)
        return moe.routed_experts_reference(x, ones, ids, gate_up, down, limit, weight_before_down)

    halves = (gate_up[0, :intermediate], gate_up[0, intermediate:], down[0])
    return moe.SharedExpert(forward, halves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weight_before_down", [False, True])
@pytest.mark.parametrize("swiglu_limit", [None, 0.5])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (3, 1), (2, 3)])
def test_shared_expert_as_one_more_pair(
    monkeypatch, num_tokens, top_k, gated, swiglu_limit, weight_before_down, dtype
):
    """The shared expert run as pair t * (k + 1) + k of the GEMVs equals its forward added
    by moe_combine (the separate path), and the reference's ops; the pair path launches
    neither of the forward's GEMMs (it is never called)."""
    args = _inputs(num_tokens, 8, top_k, 64, 32, dtype, 7)
    options = dict(swiglu_limit=swiglu_limit, weight_before_down=weight_before_down)
    shared = _shared_expert(64, 32, dtype, 8, swiglu_limit, weight_before_down)
    generator = torch.Generator().manual_seed(9)
    gate = (torch.randn(1, 64, generator=generator) / 8).to(DEVICE, dtype) if gated else None
    separate = _fused(monkeypatch, True, *args, **options, shared=shared.forward(args[0]),
                      shared_gate=gate)  # fmt: skip
    calls = []
    counted = moe.SharedExpert(lambda x: calls.append(x) or shared.forward(x), shared.weights)
    out = _fused(monkeypatch, True, *args, **options, shared_gate=gate, shared_expert=counted)
    assert calls == []
    routed = moe.routed_experts_reference(*args, **options)
    expected = moe_combine_reference(routed[:, None], shared.forward(args[0]), args[0], gate)
    torch.testing.assert_close(out, separate, **_tolerance(dtype))
    torch.testing.assert_close(out, expected, **_tolerance(dtype))
    # the grouped GEMMs (and a pair count past the rule) call the forward instead
    grouped = _fused(monkeypatch, False, *args, **options, shared_gate=gate, shared_expert=counted)
    assert len(calls) == 1
    torch.testing.assert_close(grouped, expected, **_tolerance(dtype))


def test_shared_pair_exact_in_fp32(monkeypatch):
    """Integer inputs (every sum exact in any order): the shared pair equals its forward
    plus the routed sum to the bit."""
    args = _integer_inputs([[0, 3], [3, 5]], num_experts=6)
    shared = moe.SharedExpert(
        lambda x: moe.routed_experts_reference(
            x,
            torch.ones(x.shape[0], 1, device=x.device),
            torch.full((x.shape[0], 1), 1, device=x.device),
            *args[3:],
        ),
        (args[3][1, :32], args[3][1, 32:], args[4][1]),  # expert 1's weights, no pair's
    )
    out = _fused(monkeypatch, True, *args, shared_expert=shared)
    assert torch.equal(out, moe.routed_experts_reference(*args) + shared.forward(args[0]))


def test_shared_weights_that_do_not_fit_run_the_forward(monkeypatch):
    """Another intermediate size, dtype or a transposed weight: the forward runs (and the
    switch SHARED_PAIR off does the same)."""
    args = _inputs(1, 8, 2, 64, 32, torch.float32, 7)
    base = _shared_expert(64, 32, torch.float32, 8)
    gate, up, down = base.weights
    wide = _shared_expert(64, 48, torch.float32, 8)
    for weights in (wide.weights, (gate.half(), up.half(), down.half()), (gate, up, down.t())):
        assert not moe_gemv.fits_shared(weights, args[0], args[3])
    assert moe_gemv.fits_shared(base.weights, args[0], args[3])
    calls = []
    for forward_of, weights in ((wide, wide.weights), (base, (gate, up, down.t()))):
        expert = moe.SharedExpert(lambda x, f=forward_of: calls.append(1) or f.forward(x), weights)
        out = _fused(monkeypatch, True, *args, shared_expert=expert)
        expected = moe.routed_experts_reference(*args) + forward_of.forward(args[0])
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(moe, "SHARED_PAIR", False)
    _fused(monkeypatch, True, *args, shared_expert=moe.SharedExpert(
        lambda x: calls.append(1) or base.forward(x), base.weights))  # fmt: skip
    assert len(calls) == 3


def test_gemv_tiles_override(monkeypatch):
    """Fixed tiles: several K chunks (pipelined) with a masked tail, column tiles past the
    end of I and H."""
    args = _inputs(2, 6, 2, 48, 40, torch.float32, 6)
    expected = moe.routed_experts_reference(*args, 0.5)
    tiles = moe_gemv.MoeGemvTiles(block_n=16, block_k=16, num_warps=2, num_stages=2)
    monkeypatch.setattr(moe_gemv, "TILES_OVERRIDE", (tiles, moe_gemv.MoeGemvTiles(8, 32)))
    torch.testing.assert_close(_fused(monkeypatch, True, *args, 0.5), expected)


def test_gemv_tiles_follow_the_shape():
    """16 rows over a chunk's tiles (8 for gate/up's two), chunks of 256, one stage; fewer
    only where the layer has fewer (the documented values)."""
    assert moe_gemv.gemv_tiles(512, 2048, weight_tiles=2) == moe_gemv.MoeGemvTiles(8, 256, 4, 1)
    assert moe_gemv.gemv_tiles(2048, 512) == moe_gemv.MoeGemvTiles(16, 256, 4, 1)
    assert moe_gemv.gemv_tiles(2048, 4096, weight_tiles=2) == moe_gemv.MoeGemvTiles(8, 256, 4, 1)
    assert moe_gemv.gemv_tiles(4, 64) == moe_gemv.MoeGemvTiles(4, 64, 4, 1)


def test_the_rule_picks_the_path(monkeypatch):
    """GEMV up to DECODE_GEMV_MAX_PAIRS pairs and no more pairs than experts, the grouped
    GEMMs past either or with their tiles given; the override forces either."""
    calls = []

    def spy(name):
        def run(x, *args):
            calls.append(name)
            return torch.zeros(x.shape[0] * args[1].shape[1], x.shape[1])

        return run

    monkeypatch.setattr(moe_gemv, "routed_pairs", spy("gemv"))
    monkeypatch.setattr(moe, "_grouped_pairs", spy("grouped"))
    limit = moe.DECODE_GEMV_MAX_PAIRS
    ids = torch.zeros(limit + 1, 1, dtype=torch.long)
    x, weights = torch.zeros(limit + 1, 16), torch.ones(limit + 1, 1)
    experts = limit + 16  # more experts than the cap: the cap decides
    gate_up, down = torch.zeros(experts, 16, 16), torch.zeros(experts, 16, 8)

    def path(tokens, experts=experts, **kwargs):
        calls.clear()
        moe.fused_moe(x[:tokens], weights[:tokens], ids[:tokens], gate_up[:experts],
                      down[:experts], **kwargs)  # fmt: skip
        return calls[0]

    assert path(1) == path(limit) == "gemv"
    assert path(limit + 1) == "grouped"
    assert path(4, experts=4) == "gemv"  # fewer experts than the cap: they decide
    assert path(5, experts=4) == "grouped"
    assert path(1, tiles=moe.MoeTiles(16, 16, 16)) == "grouped"
    monkeypatch.setattr(moe, "DECODE_GEMV_OVERRIDE", False)
    assert path(1) == "grouped"
    monkeypatch.setattr(moe, "DECODE_GEMV_OVERRIDE", True)
    assert path(limit + 1) == "gemv"


# -- on the GPU ----------------------------------------------------------------------------------

SHAPES = {
    "qwen3-next": dict(num_experts=64, top_k=10, hidden=2048, intermediate=512),
    "deepseek-v4": dict(num_experts=16, top_k=6, hidden=4096, intermediate=2048),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 4])
@pytest.mark.parametrize("swiglu_limit", [None, 10.0])
def test_gemv_bf16_cuda(monkeypatch, shape, num_tokens, swiglu_limit):
    args = _inputs(num_tokens, **SHAPES[shape], dtype=torch.bfloat16, seed=4)
    out = _fused(monkeypatch, True, *args, swiglu_limit)
    grouped = _fused(monkeypatch, False, *args, swiglu_limit)
    expected = moe.routed_experts_reference(*args, swiglu_limit)
    scale = expected.float().abs().max()
    assert (out.float() - expected.float()).abs().max() <= 2e-2 * scale
    assert (out.float() - grouped.float()).abs().max() <= 2e-2 * scale


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_shared_pair_bf16_cuda(monkeypatch, shape, num_tokens):
    """The shared expert as one more pair against its forward added apart (V4's clamp on
    its shape), at the models' shapes."""
    limit = 10.0 if shape == "deepseek-v4" else None
    dims = SHAPES[shape]
    args = _inputs(num_tokens, **dims, dtype=torch.bfloat16, seed=4)
    shared = _shared_expert(dims["hidden"], dims["intermediate"], torch.bfloat16, 5, limit)
    out = _fused(monkeypatch, True, *args, limit, shared_expert=shared)
    expected = moe.routed_experts_reference(*args, limit) + shared.forward(args[0])
    scale = expected.float().abs().max()
    assert (out.float() - expected.float()).abs().max() <= 2e-2 * scale


@pytest.mark.gpu
def test_gemv_is_graph_capturable_without_host_sync(monkeypatch):
    x, weights, ids, gate_up, down = _inputs(
        1, **SHAPES["qwen3-next"], dtype=torch.bfloat16, seed=5
    )
    monkeypatch.setattr(moe, "DECODE_GEMV_OVERRIDE", True)
    moe.fused_moe(x, weights, ids, gate_up, down)  # compile outside capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe.fused_moe(x, weights, ids, gate_up, down)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, weights, ids, gate_up, down)
    generator = torch.Generator().manual_seed(6)
    ids.copy_(torch.rand(1, 64, generator=generator).topk(10, dim=-1).indices)
    weights.copy_(torch.rand(weights.shape, generator=generator))
    graph.replay()
    torch.testing.assert_close(out, moe.fused_moe(x, weights, ids, gate_up, down))

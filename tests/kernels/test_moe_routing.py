"""The fused MoE routing (atom/kernels/moe_routing.py: DeepSeek-V4's `v4_route`, Qwen3-Next's
`softmax_route`) against its torch reference, the tie rule (lower expert index first) on exact
ties, and the reference against the model's own ops: CPU interpreter, `gpu` variants on
CUDA."""

import pytest
import torch
from torch.nn import functional as F

from atom.kernels.moe_routing import (
    softmax_route,
    softmax_route_reference,
    v4_route,
    v4_route_reference,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SCALE = 2.5


def _logits(tokens, experts, top_k, generator, dtype, device):
    """Strided rows whose top k + 1 logits, at random experts, are 0.5 apart (1, 1.5, ...) and
    the rest below -2: the choice does not hang on a last bit (the interpreter truncates to
    bf16 where torch rounds)."""
    rows = torch.rand(tokens, experts + 3, generator=generator) * -6 - 2
    for row in rows:
        best = torch.randperm(experts, generator=generator)[: top_k + 1]
        row[best] = 1 + 0.5 * torch.randperm(top_k + 1, generator=generator).float()
    return rows.to(device=device, dtype=dtype)[:, :experts]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,top_k", [(16, 6), (12, 3), (256, 8)])
def test_score_routing_matches_reference(device, dtype, experts, top_k):
    g = torch.Generator().manual_seed(experts + top_k)
    logits = _logits(5, experts, top_k, g, dtype, device)
    bias = (torch.rand(experts, generator=g) * 0.01).to(device)  # reorders nothing
    weights, ids = v4_route(logits, top_k, SCALE, bias=bias)
    ref_weights, ref_ids = v4_route_reference(logits, top_k, SCALE, bias=bias)
    assert ids.dtype == torch.int64 and weights.dtype == dtype
    assert torch.equal(ids, ref_ids)
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(weights, ref_weights, **tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_lower_expert_first(device, dtype):
    """Exact ties (equal logits, zero bias; and a bias that makes two choices equal): the
    lower expert index wins and comes first, in the kernel and the reference alike."""
    logits = torch.tensor(
        [
            [1.0, 2.0, 2.0, 0.5, 2.0, 2.0, -1.0, 0.0],  # four-way tie at the top, k = 3
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # all equal
            [3.0, -2.0, 1.0, 1.0, 1.0, -5.0, 30.0, 25.0],  # tie at the cut, softplus > 20
        ]
    ).to(device=device, dtype=dtype)
    bias = torch.zeros(8, device=device)
    weights, ids = v4_route(logits, 3, SCALE, bias=bias)
    ref_weights, ref_ids = v4_route_reference(logits, 3, SCALE, bias=bias)
    expected = torch.tensor([[1, 2, 4], [0, 1, 2], [6, 7, 0]], device=device)
    assert torch.equal(ref_ids, expected) and torch.equal(ids, expected)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hash_routing_matches_reference(device, dtype):
    g = torch.Generator().manual_seed(3)
    experts, top_k, vocab = 16, 6, 50
    logits = (torch.randn(4, experts, generator=g) * 4).to(device=device, dtype=dtype)
    tid2eid = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(vocab)])
    tid2eid, input_ids = tid2eid.to(device), torch.tensor([0, 49, 7, 7], device=device)
    weights, ids = v4_route(logits, top_k, SCALE, input_ids=input_ids, tid2eid=tid2eid)
    ref_weights, ref_ids = v4_route_reference(logits, top_k, SCALE, None, input_ids, tid2eid)
    assert torch.equal(ids, ref_ids) and torch.equal(ids, tid2eid[input_ids])
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(weights, ref_weights, **tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 6), (256, 8)])
def test_score_routing_with_temperature_matches_v41_ops(device, experts, top_k):
    """DeepSeek-V4.1: fp32 logits / gate_temp, then V4's rule; the reference against
    `DeepseekV41MoE.route`'s CPU ops (the same experts in the same order, no ties), the
    kernel against both."""
    g = torch.Generator().manual_seed(experts + top_k + 1)
    logits = _logits(5, experts, top_k, g, torch.float32, device)
    bias = (torch.rand(experts, generator=g) * 0.01).to(device)
    temperature = 0.8
    weights, ids = v4_route(logits, top_k, SCALE, bias=bias, temperature=temperature)
    ref_weights, ref_ids = v4_route_reference(logits, top_k, SCALE, bias, temperature=temperature)
    scores = F.softplus(logits / temperature).sqrt()  # DeepseekV41MoE.route (norm_topk)
    model_ids = (scores + bias).topk(top_k, dim=-1).indices
    model_weights = scores.gather(1, model_ids)
    model_weights = model_weights / (model_weights.sum(dim=-1, keepdim=True) + 1e-20) * SCALE
    assert torch.equal(ref_ids, model_ids) and torch.equal(ids, model_ids)
    assert torch.equal(ref_weights, model_weights)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, model_weights, rtol=1e-6, atol=1e-6)
    # the temperature changes the weights (the softplus is not scale-invariant)
    assert not torch.allclose(v4_route(logits, top_k, SCALE, bias=bias)[0], weights)


def test_no_tokens():
    weights, ids = v4_route(torch.zeros(0, 16), 6, SCALE, bias=torch.zeros(16))
    assert weights.shape == ids.shape == (0, 6)


def test_reference_is_the_models_math():
    """The reference against `DeepseekV4MoE.forward`'s ops (HF's), with no ties: the same
    experts (as sets: HF's topk is unsorted) and the same weights (the weights' sum runs in
    another order: fp32 may differ in the last bit)."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(6, 16, generator=g) * 3).to(dtype)
        bias = torch.randn(16, generator=g) * 0.1
        scores = F.softplus(logits).sqrt()
        ids = torch.topk(scores + bias, 6, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * SCALE
        ref_weights, ref_ids = v4_route_reference(logits, 6, SCALE, bias=bias)
        order, ref_order = ids.argsort(dim=-1), ref_ids.argsort(dim=-1)
        assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
        torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order))


# -- softmax routing (Qwen3-Next) ----------------------------------------------------------------


def _softmax_model_ops(logits, top_k, renormalize):
    """`Qwen3NextSparseMoeBlock.route`'s CPU ops (HF's)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,top_k", [(64, 10), (12, 3), (512, 10)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_routing_matches_model_ops(device, dtype, experts, top_k, renormalize):
    """Kernel and reference against the model's ops: the same experts in the same order
    (no ties), the weights within the last bits (exp and the sums run in another order)."""
    g = torch.Generator().manual_seed(experts + top_k)
    logits = _logits(5, experts, top_k, g, dtype, device)
    weights, ids = softmax_route(logits, top_k, renormalize)
    ref_weights, ref_ids = softmax_route_reference(logits, top_k, renormalize)
    model_weights, model_ids = _softmax_model_ops(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == dtype
    assert torch.equal(ids, model_ids) and torch.equal(ref_ids, model_ids)
    assert torch.equal(ref_weights, model_weights)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(weights, model_weights, **tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_routing_random_logits(device):
    """Gaussian bf16 logits, as a router makes them: where the top k + 1 logits of a row
    are distinct, the same experts in the same order as torch.topk."""
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(16, 64, generator=g) * 2).to(device=device, dtype=torch.bfloat16)
    weights, ids = softmax_route(logits, 10, True)
    model_weights, model_ids = _softmax_model_ops(logits, 10, True)
    top = logits.float().sort(dim=-1, descending=True).values[:, :11]
    distinct = (top[:, 1:] != top[:, :-1]).all(dim=-1)
    assert distinct.sum() >= 4
    assert torch.equal(ids[distinct], model_ids[distinct])
    torch.testing.assert_close(weights[distinct], model_weights[distinct], rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_ties_lower_expert_first(device):
    logits = torch.tensor(
        [
            [1.0, 2.0, 2.0, 0.5, 2.0, 2.0, -1.0, 0.0],  # four-way tie at the top, k = 3
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # all equal
            [3.0, -2.0, 1.0, 1.0, 1.0, -5.0, 30.0, 25.0],  # tie at the cut
        ]
    ).to(device=device, dtype=torch.bfloat16)
    weights, ids = softmax_route(logits, 3, True)
    ref_weights, ref_ids = softmax_route_reference(logits, 3, True)
    expected = torch.tensor([[1, 2, 4], [0, 1, 2], [6, 7, 0]], device=device)
    assert torch.equal(ref_ids, expected) and torch.equal(ids, expected)
    torch.testing.assert_close(weights, ref_weights, rtol=8e-3, atol=1e-5)


def test_softmax_no_tokens():
    weights, ids = softmax_route(torch.zeros(0, 64), 10, True)
    assert weights.shape == ids.shape == (0, 10)

"""moe_combine (atom/kernels/moe_combine.py: the routed sum over k plus the gated shared
expert, one launch) against the models' torch ops, and fused_moe / routed_experts with a
shared expert against their references: CPU interpreter, `gpu` variants on CUDA."""

import pytest
import torch

from atom.kernels import moe
from atom.kernels.moe_combine import moe_combine, moe_combine_reference
from atom.models.moe import routed_experts

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _inputs(tokens, top_k, hidden, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    per_pair = torch.randn(tokens, top_k, hidden, generator=g)
    shared, x = torch.randn(2, tokens, hidden, generator=g).unbind(0)
    gate = torch.randn(1, hidden, generator=g) * hidden**-0.5
    return [t.to(device=device, dtype=dtype) for t in (per_pair, shared, x, gate)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 10, 64), (3, 1, 48), (5, 4, 1100)])
@pytest.mark.parametrize("gated", [True, False])
def test_combine_matches_model_ops(device, dtype, tokens, top_k, hidden, gated):
    """Against `routed + sigmoid(shared_expert_gate(x)) * shared` (Qwen3-Next's ops, the
    routed sum torch's): fp32 to the last bits, bf16 within a last bit or two (the dot and
    the sum run in another order; the interpreter truncates where the GPU rounds)."""
    per_pair, shared, x, gate = _inputs(tokens, top_k, hidden, dtype, device)
    gate = gate if gated else None
    out = moe_combine(per_pair, shared, x, gate)
    routed = per_pair.sum(dim=1)
    if gated:
        expected = routed + torch.sigmoid(torch.nn.functional.linear(x, gate)) * shared
    else:
        expected = routed + shared
    assert torch.equal(moe_combine_reference(per_pair, shared, x, gate), expected)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, expected, **tolerance)


def test_combine_no_tokens():
    per_pair, shared, x, gate = _inputs(0, 10, 64, torch.float32, "cpu")
    assert moe_combine(per_pair, shared, x, gate).shape == (0, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gated", [True, False])
def test_fused_moe_with_shared_matches_reference(device, gated):
    """fused_moe's epilogue with a shared expert against the reference path's ops."""
    g = torch.Generator().manual_seed(3)
    tokens, experts, top_k, hidden, inter = 3, 8, 2, 64, 32
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    shared = torch.randn(tokens, hidden, generator=g)
    gate = torch.randn(1, hidden, generator=g) * hidden**-0.5 if gated else None
    args = [t.to(device) for t in (x, weights, ids, gate_up, down)]
    shared, gate = shared.to(device), gate.to(device) if gated else None
    out = moe.fused_moe(*args, shared=shared, shared_gate=gate)
    routed = moe.routed_experts_reference(*args)
    expected = moe_combine_reference(routed[:, None], shared, args[0], gate)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    cpu_gate = gate.cpu() if gated else None
    on_cpu = routed_experts(*[t.cpu() for t in args], shared=shared.cpu(), shared_gate=cpu_gate)
    torch.testing.assert_close(on_cpu.to(device), expected, rtol=1e-4, atol=1e-4)

"""routed_experts (atom/models/moe.py) against HF transformers' expert loops.

On CPU it runs the torch reference: bit-identical to DeepseekV2Experts (fp32 and bf16) and
to DeepseekV4Experts with its swiglu_limit clamp (skipped where transformers has no V4).
"""

import pytest
import torch
import transformers

from atom.models.moe import routed_experts

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 8, 3, 64, 32


def _routing(num_tokens, generator):
    ids = torch.stack(
        [torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(num_tokens)]
    )
    return torch.rand(num_tokens, TOP_K, generator=generator), ids


def _fill(experts, dtype, generator, scale=0.2):
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.copy_(scale * torch.randn(weight.shape, generator=generator))
    return experts.to(dtype)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_matches_hf_deepseek_v2_experts(dtype, num_tokens):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Experts

    generator = torch.Generator().manual_seed(num_tokens)
    config = transformers.DeepseekV2Config(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        n_routed_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
    )
    experts = _fill(DeepseekV2Experts(config), dtype, generator)
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
    weights, ids = _routing(num_tokens, generator)
    with torch.no_grad():
        expected = experts(x, ids, weights)
    out = routed_experts(x, weights, ids, experts.gate_up_proj.data, experts.down_proj.data)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_matches_hf_deepseek_v4_experts_with_swiglu_limit():
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    generator = torch.Generator().manual_seed(4)
    limit = 0.5  # small against gate/up of about +-2: most entries are clamped
    config = transformers.DeepseekV4Config(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        n_routed_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        swiglu_limit=limit,
    )
    experts = _fill(v4.DeepseekV4Experts(config), torch.float32, generator, scale=0.5)
    assert experts.limit == limit
    x = torch.randn(9, HIDDEN, generator=generator)
    weights, ids = _routing(9, generator)
    with torch.no_grad():
        expected = experts(x, ids, weights)
    args = (x, weights, ids, experts.gate_up_proj.data, experts.down_proj.data)
    torch.testing.assert_close(routed_experts(*args, swiglu_limit=limit), expected, rtol=0, atol=0)
    assert (routed_experts(*args) - expected).abs().max() > 1.0  # the clamp matters here


def test_no_tokens():
    gate_up = torch.zeros(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN)
    down = torch.zeros(NUM_EXPERTS, HIDDEN, INTERMEDIATE)
    x = torch.zeros(0, HIDDEN)
    ids = torch.zeros(0, TOP_K, dtype=torch.int64)
    assert routed_experts(x, torch.zeros(0, TOP_K), ids, gate_up, down).shape == (0, HIDDEN)

"""routed_experts (atom/models/moe.py) against HF transformers' expert loops.

On CPU it runs the torch reference: bit-identical to DeepseekV2Experts (fp32 and bf16) and
to DeepseekV4Experts with its swiglu_limit clamp (skipped where transformers has no V4).
"""

import os

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


@pytest.mark.gpu
def test_deepseek_moe_on_cuda_makes_no_host_sync_and_matches_cpu():
    """The layer as the engine runs it: router, fused routed experts, shared experts. On
    CUDA, a host sync raises (sync debug mode); the output equals the CPU reference's."""
    from types import SimpleNamespace

    from atom.models.deepseek_v2 import DeepseekMoE

    config = SimpleNamespace(
        model_type="deepseek_v2",
        hidden_size=256,
        moe_intermediate_size=128,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        topk_method="greedy",
        norm_topk_prob=False,
    )
    torch.manual_seed(0)
    moe = DeepseekMoE(config)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5)
        x = torch.randn(37, 256)
        expected = moe(x)
        moe, x = moe.cuda(), x.cuda()  # (a pageable host-to-device copy syncs)
        moe(x)  # compile the kernels first
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = moe(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_shared_in_the_combine_equals_the_separate_add(monkeypatch):
    """routed_experts(shared=...) without a gate (DeepSeek-V2/V3/V4/V4.1): the CUDA path
    under the interpreter adds the shared output in the k-sum launch, bit-equal to the
    separate add it replaced (the routed sum, then + shared), close to the CPU reference.
    fp32 only: the interpreter's bf16 GEMMs are not CUDA's (bf16 runs in the `gpu` tests)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":  # read when the kernels are decorated
        pytest.skip("needs TRITON_INTERPRET=1 from the start")

    generator = torch.Generator().manual_seed(7)
    gate_up = 0.2 * torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator)
    down = 0.2 * torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=generator)
    x = torch.randn(5, HIDDEN, generator=generator)
    shared = torch.randn(5, HIDDEN, generator=generator)
    weights, ids = _routing(5, generator)
    args = (x, weights, ids, gate_up, down, 0.5)
    expected = routed_experts(*args, shared=shared)  # the CPU reference + add_shared
    monkeypatch.setenv("ATOM_INTERPRET_CUDA_PATH", "1")
    combined = routed_experts(*args, shared=shared)
    assert torch.equal(combined, routed_experts(*args) + shared)
    # the interpreted GEMMs sum in another order than the reference's
    torch.testing.assert_close(combined, expected, rtol=1e-5, atol=1e-5)


def _fp8_deepseek_moe(block, num_shared=0):
    """DeepseekMoE of a DeepSeek block-FP8 checkpoint (`weight_block_size` = block): routed
    (and shared) experts fp8 with random float32 scales, a float32 router."""
    from types import SimpleNamespace

    from atom.models.deepseek_v2 import DeepseekMoE

    config = SimpleNamespace(
        model_type="deepseek_v2",
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        n_routed_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        n_shared_experts=num_shared,
        routed_scaling_factor=1.0,
        topk_method="greedy",
        norm_topk_prob=False,
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block},
    )
    generator = torch.Generator().manual_seed(sum(block))
    moe = DeepseekMoE(config, prefix="model.layers.1.mlp")
    with torch.no_grad():
        for name, tensor in (*moe.named_parameters(), *moe.named_buffers()):
            values = torch.randn(tensor.shape, generator=generator)
            if tensor.dtype == torch.float8_e4m3fn:
                tensor.copy_(values.to(tensor.dtype))
            elif "scale" in name:  # fp8 values of about +-1 to outputs of about +-1
                tensor.copy_((0.5 + values.abs()) / (8 * HIDDEN**0.5))
            else:  # the router
                tensor.copy_(values * HIDDEN**-0.5)
    return moe


@pytest.mark.parametrize("block", [[16, 16], [24, 32]])  # 24: up rows start inside a block
def test_deepseek_fp8_moe_cuda_path_reads_fp8_and_matches_cpu(block, monkeypatch):
    """The layer's CUDA path under the interpreter (ATOM_INTERPRET_CUDA_PATH=1): the fused
    kernels read the FP8 experts (no dequantized copy), output as the CPU path's (which
    dequantizes the experts it routes to, then runs the reference)."""
    from atom.models.quantization.experts import Fp8Experts

    pytest.importorskip("triton")
    moe = _fp8_deepseek_moe(block)
    assert isinstance(moe.experts, Fp8Experts)
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(2))
    monkeypatch.setenv("ATOM_INTERPRET_CUDA_PATH", "0")
    with torch.no_grad():
        expected = moe(x)
        monkeypatch.setenv("ATOM_INTERPRET_CUDA_PATH", "1")
        monkeypatch.setattr(Fp8Experts, "dense", None)  # the CUDA path must not call it
        out = moe(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_deepseek_fp8_moe_on_cuda_makes_no_host_sync_and_matches_cpu():
    """bf16 on CUDA (the fused FP8 kernels, a shared FP8 expert) against the CPU path in
    bf16: within the bf16 MoE tests' tolerance."""
    moe = _fp8_deepseek_moe([32, 32], num_shared=1)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = moe(x.bfloat16())
        moe, x = moe.cuda(), x.cuda().bfloat16()
        moe(x)  # compile the kernels first
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = moe(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    scale = expected.float().abs().max()
    assert (out.cpu().float() - expected.float()).abs().max() <= 2e-2 * scale

"""Qwen3-Next's CUDA path (fused Triton kernels) against its torch path, module by module:
the sparse MoE block (router, experts, gated shared expert), the GDN layer's work around
its conv and delta rule (split, g, beta, gated norm) and the gated attention's norms and
partial rotary. On the CPU under Triton's
interpreter (ATOM_INTERPRET_CUDA_PATH=1), on CUDA with the `gpu` marker."""

import copy
from types import SimpleNamespace

import pytest
import torch

from atom.models.qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextGatedDeltaNet,
    Qwen3NextSparseMoeBlock,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _dtype(device, half):
    """fp32, or the 16-bit type: bf16 on CUDA, fp16 under the interpreter (its bf16 tl.dot
    is not numpy's)."""
    if not half:
        return torch.float32
    return torch.bfloat16 if device == "cuda" else torch.float16


def _moe_block(dtype, device):
    config = SimpleNamespace(
        num_experts_per_tok=4, norm_topk_prob=True, num_experts=16, hidden_size=64,
        moe_intermediate_size=32, shared_expert_intermediate_size=48,
    )  # fmt: skip
    block = Qwen3NextSparseMoeBlock(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * param.shape[-1] ** -0.5)
    return block.to(device=device, dtype=dtype)


def _torch_path(module, *args, monkeypatch):
    """(route ids, output) of the torch path: on the CPU before the interpreted CUDA path is
    turned on, on CUDA from a CPU copy."""
    if args[0].is_cuda:
        cpu = copy.deepcopy(module).cpu()
        cpu_args = [a.cpu() for a in args]
        return cpu.route(*cpu_args)[1].to(args[0].device), cpu(*cpu_args).to(args[0].device)
    result = module.route(*args)[1], module(*args)
    monkeypatch.setenv("ATOM_INTERPRET_CUDA_PATH", "1")
    return result


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", [False, True])
def test_moe_block_fused_matches_torch_path(device, half, monkeypatch):
    dtype = _dtype(device, half)
    block = _moe_block(dtype, device)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    with torch.no_grad():
        expected_ids, expected = _torch_path(block, x, monkeypatch=monkeypatch)
        ids, out = block.route(x)[1], block(x)
    # the same experts (no near-ties at these seeds), the outputs to the last bits
    assert torch.equal(ids.sort(-1).values.cpu(), expected_ids.sort(-1).values.cpu())
    tolerance = dict(rtol=3e-2, atol=3e-2) if half else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, expected, **tolerance)


class _RecordingState(torch.nn.Module):
    """Stands in for the GDN state (conv + delta rule, tested in tests/kernels): records its
    inputs and returns a function of all of them, [T, Hv, Dv] in the input's dtype."""

    def __init__(self, num_v_heads, head_v_dim):
        super().__init__()
        self.num_v_heads, self.head_v_dim = num_v_heads, head_v_dim
        self.calls = []

    def forward(self, mixed, conv_weight, g, beta):
        self.calls.append((mixed, g, beta.float()))
        count, heads, dv = mixed.shape[0], self.num_v_heads, self.head_v_dim
        v = mixed[:, -heads * dv :].float().view(count, heads, dv)
        mix = mixed[:, : heads * dv].float().view(count, heads, dv) * conv_weight[0, 0].float()
        return (v * beta.float()[..., None] + g[..., None] + mix).to(mixed.dtype)


def _gdn_layer(dtype, device):
    config = SimpleNamespace(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, hidden_size=32, rms_norm_eps=1e-6,
    )  # fmt: skip
    layer = Qwen3NextGatedDeltaNet(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * param.shape[-1] ** -0.5)
    layer.attn = _RecordingState(4, 8)
    return layer.to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", [False, True])
def test_gdn_layer_fused_matches_torch_path(device, half, monkeypatch):
    dtype = _dtype(device, half)
    layer = _gdn_layer(dtype, device)
    hidden = torch.randn(3, 32, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    positions = torch.arange(3, device=device)
    with torch.no_grad():
        if device == "cuda":
            reference = copy.deepcopy(layer).cpu()
            expected = reference(positions.cpu(), hidden.cpu()).to(device)
            ((mixed, g, beta),) = [[t.to(device) for t in call] for call in reference.attn.calls]
        else:
            expected = layer(positions, hidden)
            ((mixed, g, beta),) = layer.attn.calls
            layer.attn.calls.clear()
            monkeypatch.setenv("ATOM_INTERPRET_CUDA_PATH", "1")
        out = layer(positions, hidden)
    ((fused_mixed, fused_g, fused_beta),) = layer.attn.calls
    # the conv's input a copy; g and beta to the last bits (exp's; beta's bf16 rounding)
    _assert_same_copy(fused_mixed, mixed, half)
    torch.testing.assert_close(fused_g, g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_beta, beta, rtol=8e-3 if half else 1e-5, atol=1e-6)
    tolerance = dict(rtol=3e-2, atol=3e-2) if half else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, expected, **tolerance)


def _assert_same_copy(got, want, half):
    """A tensor the fused path copies (or passes on) from a projection: bit-equal on the CPU,
    where both paths read one projection; on CUDA the torch path runs on a CPU copy, whose
    projection sums in another order than cuBLAS's (an H200 run: fp32 not bit-equal)."""
    if got.device.type == "cpu":
        assert torch.equal(got, want)
    else:
        tolerance = dict(rtol=8e-3, atol=8e-3) if half else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, **tolerance)


class _RecordingAttention(torch.nn.Module):
    """Stands in for the paged attention: records q, k, v and returns a function of them."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, q, k, v):
        self.calls.append((q.clone(), k.clone(), v.clone()))
        kv = (k.float().sum(1, keepdim=True) + v.float().sum(1, keepdim=True)) / k.shape[1]
        return (q.float() + kv).flatten(1).to(q.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", [False, True])
def test_attention_fused_matches_torch_path(device, half, monkeypatch):
    dtype = _dtype(device, half)
    config = SimpleNamespace(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=32,
        attention_bias=False, rms_norm_eps=1e-6, rope_theta=10000.0,
        partial_rotary_factor=0.25, rope_scaling=None,
    )  # fmt: skip
    layer = Qwen3NextAttention(config, max_position=64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * param.shape[-1] ** -0.5)
    layer.attn = _RecordingAttention()
    layer = layer.to(device=device, dtype=dtype)
    layer.rotary.cos, layer.rotary.sin = layer.rotary.cos.float(), layer.rotary.sin.float()
    hidden = torch.randn(3, 32, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    positions = torch.tensor([0, 5, 63], device=device)
    with torch.no_grad():
        if device == "cuda":
            reference = copy.deepcopy(layer).cpu()
            expected = reference(positions.cpu(), hidden.cpu()).to(device)
            ((q, k, v),) = [[t.to(device) for t in call] for call in reference.attn.calls]
        else:
            expected = layer(positions, hidden)
            ((q, k, v),) = layer.attn.calls
            layer.attn.calls.clear()
            monkeypatch.setenv("ATOM_INTERPRET_CUDA_PATH", "1")
        out = layer(positions, hidden)
    ((fused_q, fused_k, fused_v),) = layer.attn.calls
    # the rotary rounds once where torch rounds each op (atom/kernels/rotary.py)
    tolerance = dict(rtol=3e-2, atol=3e-2) if half else dict(rtol=1e-5, atol=1e-5)
    _assert_same_copy(fused_v, v, half)
    torch.testing.assert_close(fused_q, q, **tolerance)
    torch.testing.assert_close(fused_k, k, **tolerance)
    torch.testing.assert_close(out, expected, **tolerance)

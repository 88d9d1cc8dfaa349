"""Qwen3-Next's CUDA path (fused Triton kernels) against its torch path, module by module:
the sparse MoE block (router, experts, gated shared expert). On the CPU under Triton's
interpreter (ATOM_INTERPRET_CUDA_PATH=1), on CUDA with the `gpu` marker."""

import copy
from types import SimpleNamespace

import pytest
import torch

from atom.models.qwen3_next import Qwen3NextSparseMoeBlock

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

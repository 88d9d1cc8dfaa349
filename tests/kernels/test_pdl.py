"""Programmatic dependent launch (atom/kernels/pdl.py): which launches take it (the rules
of ``pdl_launch``, the device's support faked) and the kernels' PDL code paths under the
interpreter (the GPU tests run them with the real launch; PDL is on by default there)."""

from types import SimpleNamespace

import pytest
import torch

from atom.fusions import Fusions
from atom.kernels import pdl
from tests.kernels import (
    test_decode_attention,
    test_gdn,
    test_gdn_gates,
    test_gemv,
    test_gemv_fp8,
    test_gemv_rope_kv,
    test_moe_combine,
)

ON = (1, {"launch_pdl": True})


def _on_cuda(rows: int):
    return SimpleNamespace(is_cuda=True, shape=(rows, 64), device=torch.device("cuda", 0))


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return monkeypatch


def _knobs(monkeypatch, **knobs):
    """The forward's fusions with these PDL knobs (pdl_kernels, pdl_release)."""
    monkeypatch.setattr(pdl, "current_fusions", lambda: Fusions(**knobs))


def test_small_kernels_and_latency_bound_gemvs_take_pdl(hopper):
    small_weight = 576 * 960 * 2  # SmolLM2's qkv, bf16
    big_weight = 2048 * 3072 * 2  # the 1B's
    # attention / merge / norm, whatever the step's rows (a runtime length never picks
    # another compiled variant)
    assert pdl.pdl_launch(_on_cuda(1)) == ON
    assert pdl.pdl_launch(_on_cuda(4096)) == ON
    assert pdl.pdl_launch(_on_cuda(1), small_weight) == ON
    assert pdl.pdl_launch(_on_cuda(1), big_weight) == (0, {})  # bandwidth-bound GEMV
    assert pdl.pdl_launch(_on_cuda(1), 2048 * 2048 * 2) == ON  # the 1B's o, 8.4 MB <= 10 MB
    _knobs(hopper, pdl_kernels="all")
    assert pdl.pdl_launch(_on_cuda(1), big_weight) == ON
    _knobs(hopper, pdl_kernels="small")
    assert pdl.pdl_launch(_on_cuda(1), small_weight) == (0, {})
    assert pdl.pdl_launch(_on_cuda(1)) == ON
    _knobs(hopper, pdl_kernels="latency", pdl_release="end")
    assert pdl.pdl_launch(_on_cuda(1), small_weight) == (2, {"launch_pdl": True})
    assert pdl.pdl_launch(_on_cuda(1)) == ON  # only a GEMV releases late


def test_latency_bound_weights_and_the_llama_layers_that_load_kv_early():
    """A GEMV over at most 4 MB of weight is latency-bound (PDL on, and paged decode after
    such a qkv projection loads cached K / V before its wait); the Llama layers of the
    SmolLM2-135M shape qualify, those of the 1B shape do not."""
    from atom.distributed import TensorParallelGroup
    from atom.models.llama import LlamaAttention

    meta = dict(device="meta", dtype=torch.bfloat16)
    assert pdl.latency_bound(torch.empty(960, 576, **meta))  # SmolLM2 qkv, 1.1 MB
    assert not pdl.latency_bound(torch.empty(3072, 2048, **meta))  # 1B qkv, 12.6 MB
    assert pdl.latency_bound(torch.empty(1024, 2048, **meta))  # exactly 4 MB
    assert not pdl.latency_bound(torch.empty(1024, 2048, device="meta"))  # fp32: 8 MB

    def layer(hidden, heads, kv_heads):
        config = SimpleNamespace(
            hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=64, model_type="llama", max_position_embeddings=256, rope_theta=1e4,
        )  # fmt: skip
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("meta"):
                return LlamaAttention(config, 256, TensorParallelGroup.single())
        finally:
            torch.set_default_dtype(previous)

    assert layer(576, 9, 3).attn.early_kv
    assert not layer(2048, 32, 8).attn.early_kv


def test_no_pdl_off_switch_cpu_interpreter_or_old_gpu(hopper):
    from atom.forward_context import current_fusions
    from atom.fusions import Fusions

    assert current_fusions().pdl  # on by default
    assert pdl.pdl_launch(torch.empty(1, 64)) == (0, {})  # a CPU tensor
    hopper.setenv("TRITON_INTERPRET", "1")
    assert pdl.pdl_launch(_on_cuda(1)) == (0, {})
    hopper.delenv("TRITON_INTERPRET")
    hopper.setattr(pdl, "current_fusions", lambda: Fusions(pdl=False))
    assert pdl.pdl_launch(_on_cuda(1)) == (0, {})
    hopper.setattr(pdl, "current_fusions", lambda: Fusions(pdl=True))
    assert pdl.pdl_launch(_on_cuda(1)) == ON
    hopper.setattr(pdl, "pdl_supported", lambda device: False)  # before Hopper
    assert pdl.pdl_launch(_on_cuda(1)) == (0, {})


def test_the_decode_chain_kernels_follow_the_switch(hopper):
    """The MoE / GDN chain's small kernels take PDL as the norms do, unless CHAIN is off."""
    assert pdl.pdl_chain_launch(_on_cuda(1)) == ON
    assert pdl.pdl_chain_launch(_on_cuda(64)) == ON
    hopper.setattr(pdl, "CHAIN", False)
    assert pdl.pdl_chain_launch(_on_cuda(1)) == (0, {})
    hopper.setattr(pdl, "CHAIN", True)
    _knobs(hopper, pdl=False)
    assert pdl.pdl_chain_launch(_on_cuda(1)) == (0, {})


# The kernels' PDL code paths (the one-row GEMV's first weight chunk, paged decode's block
# ids and K / V of its first tile, all loaded before the wait; the last token's K / V after
# it) against the same references as without PDL, under the interpreter: EMULATED runs
# those paths without the launch intrinsics, which the interpreter lacks.
@pytest.fixture
def emulated(monkeypatch):
    from atom.kernels import decode_attention, gemv, rmsnorm

    for module in (decode_attention, gemv, rmsnorm):
        monkeypatch.setattr(module, "pdl_launch", lambda *_, **__: (pdl.EMULATED, {}))


@pytest.mark.parametrize("in_features, out_features, config", test_gemv.ROW_CASES)
def test_one_row_gemv_pdl_paths(emulated, in_features, out_features, config):
    test_gemv.test_one_row_gemv_matches_linear(
        in_features, out_features, config, torch.float32, test_gemv.DEVICE
    )


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("block_n", [1, 8])
def test_gemv_rope_kv_pdl_paths(emulated, norm, block_n):
    test_gemv_rope_kv.test_equals_gemv_then_rotary_kv_write(torch.float32, norm, block_n, True)


@pytest.mark.parametrize("in_features, out_features, config", test_gemv.ROW_CASES[1:])
def test_fp8_one_row_gemv_pdl_paths(emulated, in_features, out_features, config):
    """The FP8 weight's first chunk loaded before the wait, x once after it."""
    test_gemv_fp8.test_fp8_one_row_gemv_matches_the_dequantized_weight(
        in_features, out_features, config, torch.float32, test_gemv.DEVICE
    )


@pytest.mark.parametrize("early_kv", [False, True])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("case", test_decode_attention.CASES)
def test_paged_decode_pdl_paths(emulated, case, num_splits, kv_cache_dtype, early_kv):
    test_decode_attention.check_decode(
        *case, torch.float32, test_decode_attention.DEVICE, num_splits, kv_cache_dtype,
        early_kv=early_kv,
    )  # fmt: skip


@pytest.fixture
def emulated_chain(monkeypatch):
    from atom.kernels import gdn_conv, gdn_delta_rule, gdn_gates, moe_combine

    for module in (gdn_conv, gdn_delta_rule, gdn_gates, moe_combine):
        monkeypatch.setattr(module, "pdl_chain_launch", lambda *_: (pdl.EMULATED, {}))


def test_gdn_conv_and_delta_rule_pdl_paths(emulated_chain):
    """The conv's state and weight, the delta rule's state, loaded before the wait."""
    test_gdn.test_conv_kernels_match_reference(4, 40)
    test_gdn.test_delta_rule_kernels_match_reference()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_split_gated_norm_and_combine_pdl_paths(emulated_chain, dtype):
    test_gdn_gates.test_split_matches_reference("cpu", dtype, 2, 2, 8, 16)
    test_gdn_gates.test_gated_norm_matches_model_norm("cpu", dtype, 2, 2, 8, 16)
    test_moe_combine.test_combine_matches_model_ops("cpu", dtype, 3, 4, 64, True)

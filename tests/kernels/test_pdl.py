"""Programmatic dependent launch (atom/kernels/pdl.py): which launches take it (the rules
of ``pdl_launch``, the device's support faked) and the kernels' PDL code paths under the
interpreter (the GPU tests run them with the real launch; PDL is on by default there)."""

from types import SimpleNamespace

import pytest
import torch

from atom.kernels import pdl
from tests.kernels import test_decode_attention, test_gemv, test_gemv_rope_kv

ON = (1, {"launch_pdl": True})


def _on_cuda(rows: int):
    return SimpleNamespace(is_cuda=True, shape=(rows, 64), device=torch.device("cuda", 0))


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for knob in ("ATOM_PDL_KERNELS", "ATOM_PDL_RELEASE"):
        monkeypatch.delenv(knob, raising=False)
    return monkeypatch


def test_small_kernels_and_latency_bound_gemvs_take_pdl(hopper):
    small_weight = 576 * 960 * 2  # SmolLM2's qkv, bf16
    big_weight = 2048 * 3072 * 2  # the 1B's
    # attention / merge / norm, whatever the step's rows (a runtime length never picks
    # another compiled variant)
    assert pdl.pdl_launch(_on_cuda(1)) == ON
    assert pdl.pdl_launch(_on_cuda(4096)) == ON
    assert pdl.pdl_launch(_on_cuda(1), small_weight) == ON
    assert pdl.pdl_launch(_on_cuda(1), big_weight) == (0, {})  # bandwidth-bound GEMV
    hopper.setenv("ATOM_PDL_KERNELS", "all")
    assert pdl.pdl_launch(_on_cuda(1), big_weight) == ON
    hopper.setenv("ATOM_PDL_KERNELS", "small")
    assert pdl.pdl_launch(_on_cuda(1), small_weight) == (0, {})
    assert pdl.pdl_launch(_on_cuda(1)) == ON
    hopper.setenv("ATOM_PDL_KERNELS", "latency")
    hopper.setenv("ATOM_PDL_RELEASE", "end")
    assert pdl.pdl_launch(_on_cuda(1), small_weight) == (2, {"launch_pdl": True})
    assert pdl.pdl_launch(_on_cuda(1)) == ON  # only a GEMV releases late


def test_the_last_launch_says_whether_it_released_early(hopper):
    """Paged decode loads cached K / V before its wait only behind a GEMV that lets it
    start early (a PDL launch releasing at once), not behind one outside the chain, one
    releasing late, or a small kernel (a norm: a projection follows it, not decode)."""
    pdl.pdl_launch(_on_cuda(1), 576 * 960 * 2)
    assert pdl.last_launch_released_early()
    pdl.pdl_launch(_on_cuda(1), 2048 * 3072 * 2)  # bandwidth-bound: plain launch
    assert not pdl.last_launch_released_early()
    pdl.pdl_launch(_on_cuda(1), 576 * 960 * 2)
    pdl.pdl_launch(_on_cuda(1))  # a norm, attention or merge kernel
    assert not pdl.last_launch_released_early()
    hopper.setenv("ATOM_PDL_RELEASE", "end")
    pdl.pdl_launch(_on_cuda(1), 576 * 960 * 2)  # releases after its K loop
    assert not pdl.last_launch_released_early()


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


# The kernels' PDL code paths (the one-row GEMV's first weight chunk, paged decode's block
# ids and K / V of its first tile, all loaded before the wait; the last token's K / V after
# it) against the same references as without PDL, under the interpreter: EMULATED runs
# those paths without the launch intrinsics, which the interpreter lacks.
@pytest.fixture
def emulated(monkeypatch):
    from atom.kernels import decode_attention, gemv, rmsnorm

    for module in (decode_attention, gemv, rmsnorm):
        monkeypatch.setattr(module, "pdl_launch", lambda *_, **__: (pdl.EMULATED, {}))
    # paged decode as behind a kernel that released early: its K / V before the wait too
    monkeypatch.setattr(decode_attention, "last_launch_released_early", lambda: True)


@pytest.mark.parametrize("in_features, out_features, config", test_gemv.ROW_CASES)
def test_one_row_gemv_pdl_paths(emulated, in_features, out_features, config):
    test_gemv.test_one_row_gemv_matches_linear(
        in_features, out_features, config, torch.float32, test_gemv.DEVICE
    )


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("block_n", [1, 8])
def test_gemv_rope_kv_pdl_paths(emulated, norm, block_n):
    test_gemv_rope_kv.test_equals_gemv_then_rotary_kv_write(torch.float32, norm, block_n)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("case", test_decode_attention.CASES)
def test_paged_decode_pdl_paths(emulated, case, num_splits, kv_cache_dtype):
    test_decode_attention.test_decode_matches_reference(
        *case, torch.float32, test_decode_attention.DEVICE, num_splits, kv_cache_dtype
    )

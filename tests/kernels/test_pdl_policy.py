"""Which launches take programmatic dependent launch (atom/kernels/pdl.py ``pdl_launch``):
the rules a CPU can check (the device's support is faked; the GPU tests run the kernels)."""

from types import SimpleNamespace

import pytest
import torch

from atom.kernels import pdl

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


def test_no_pdl_off_switch_cpu_interpreter_or_old_gpu(hopper):
    from atom.fusions import Fusions
    from atom.forward_context import current_fusions

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

"""The fused-kernel switches (atom/fusions.py): environment variables, Config, errors."""

import pytest

from atom.config import Config
from atom.fusions import DEFAULTS, Fusions, FusionSettingError, names


def test_defaults_and_environment_overrides(monkeypatch):
    for variable, _ in DEFAULTS.values():
        monkeypatch.delenv(variable, raising=False)
    assert Fusions.from_env() == Fusions()
    assert Config(device="cpu").fusions == Fusions()
    monkeypatch.setenv("ATOM_FUSE_ROPE_KV", "0")
    monkeypatch.setenv("ATOM_FUSE_GEMV_SILU", "1")
    fusions = Config(device="cpu").fusions
    assert not fusions.rope_kv_write and fusions.gemv_silu
    # an explicit Config field wins over the environment
    assert Config(device="cpu", fusions=Fusions.none()).fusions.enabled() == []
    monkeypatch.setenv("ATOM_FUSE_ARGMAX", "yes please")
    with pytest.raises(FusionSettingError, match="ATOM_FUSE_ARGMAX"):
        Fusions.from_env()


def test_pdl_knobs_read_with_the_fusions(monkeypatch):
    """ATOM_PDL_KERNELS / ATOM_PDL_RELEASE: read once with the fusions (atom/envs.py), not
    per launch; anything but their values is refused."""
    for variable in ("ATOM_PDL_KERNELS", "ATOM_PDL_RELEASE"):
        monkeypatch.delenv(variable, raising=False)
    fusions = Config(device="cpu").fusions
    assert (fusions.pdl_kernels, fusions.pdl_release) == ("latency", "start")
    monkeypatch.setenv("ATOM_PDL_KERNELS", "all")
    monkeypatch.setenv("ATOM_PDL_RELEASE", "end")
    fusions = Config(device="cpu").fusions
    assert (fusions.pdl_kernels, fusions.pdl_release) == ("all", "end")
    assert fusions.enabled() == Fusions().enabled()  # knobs, not switches
    monkeypatch.setenv("ATOM_PDL_KERNELS", "most")
    with pytest.raises(ValueError, match="ATOM_PDL_KERNELS"):
        Fusions.from_env()


def test_ablation_configurations():
    assert Fusions.none().enabled() == []
    assert Fusions.only("gemv_silu").enabled() == ["gemv_silu"]
    assert Fusions.only(*names()).enabled() == names()
    with pytest.raises(FusionSettingError, match="unknown fusions"):
        Fusions.only("fused_everything")

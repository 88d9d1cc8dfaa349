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


def test_ablation_configurations():
    assert Fusions.none().enabled() == []
    assert Fusions.only("decode_merge").enabled() == ["decode_merge"]
    assert Fusions.only(*names()).enabled() == names()
    with pytest.raises(FusionSettingError, match="unknown fusions"):
        Fusions.only("fused_everything")

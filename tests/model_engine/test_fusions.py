"""The fused-kernel switches (atom/fusions.py): environment variables, Config, errors."""

import os

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
    from benchmarks import decode_profile

    labels = [label for label, _ in decode_profile.configurations(ablate=True)]
    assert labels[0] == "baseline" and labels[-1] == "baseline_end"
    assert {*names(), "all", *decode_profile.CANDIDATE_SETS} <= set(labels)


def test_profile_kernels_table_without_a_baseline(capsys):
    """`--profile-kernels` measures the defaults alone: the table prints without speed-ups
    (no baseline to divide by), `--ablate`'s with them."""
    from benchmarks import decode_profile

    record = dict(decode_tok_s=900.0, decode_ms_per_step=1.1, kernels_per_step=180.0,
                  gpu_us_per_step=1050.0, fraction_of_weight_read_limit=0.5)  # fmt: skip
    decode_profile.print_table("shape", [("default", record)])
    assert decode_profile.baseline_ms([("default", record)]) is None
    table = capsys.readouterr().err.splitlines()[-1].split()
    assert table == ["default", "900", "1.100", "-", "180.0", "1050.0", "0.50"]
    faster = dict(record, decode_ms_per_step=0.55)
    decode_profile.print_table("shape", [("baseline", record), ("all", faster)])
    assert capsys.readouterr().err.splitlines()[-1].split()[3] == "2.000"


def test_gpu_time_counts_overlapping_kernels_once():
    """Under PDL a kernel starts before the one ahead of it ends: the step's GPU time is
    the union of the kernels' spans (here 0-10 and 12-20 us: 18 us over 2 steps), with the
    gap of 2 us a launch gap and the one of 30 us the host's."""
    from types import SimpleNamespace as Span

    from benchmarks import decode_profile

    spans = [Span(start=0, end=6), Span(start=4, end=10), Span(start=12, end=15),
             Span(start=13, end=20), Span(start=50, end=50)]  # fmt: skip
    timeline = decode_profile.gpu_gaps(spans, steps=2)
    assert timeline == dict(gpu_us_per_step=9.0, launch_gaps_us_per_step=1.0,
                            host_wait_us_per_step=15.0)  # fmt: skip


def test_decode_ab_variants_apply_and_restore(monkeypatch):
    """Each A/B variant changes its one choice inside its block and leaves the module
    GEMV policy, the split policy and the PDL knobs as they were after it."""
    import torch

    from atom.kernels import decode_attention, gemv_policy
    from benchmarks import decode_ab

    monkeypatch.setenv("ATOM_PDL_KERNELS", "all")
    policy = gemv_policy.current_policy()
    pick = decode_attention._pick_num_splits
    q = torch.empty(1, 32, 64)  # CPU: the policy itself answers 1, splits8 answers 8
    x, weight = torch.randn(1, 64), torch.randn(96, 64)
    with decode_ab.variant("gemv_fused"):
        assert gemv_policy.use_gemv(x, weight, silu_mul=True, norm=True)
    with decode_ab.variant("gemv_unfused"):
        assert not gemv_policy.use_gemv(x, weight)
    with decode_ab.variant("splits8"):
        assert decode_attention._pick_num_splits(q, 8, 784, 64) == 8
    with decode_ab.variant("pdl_small"):
        assert os.environ["ATOM_PDL_KERNELS"] == "small"
    with decode_ab.variant("pdl_late+decode_merge1+splits8"):
        assert os.environ["ATOM_PDL_RELEASE"] == "end"
        assert decode_attention.MERGED_SPLIT_TILES == 1
        assert decode_attention._pick_num_splits(q, 8, 784, 64) == 8
    assert decode_attention.MERGED_SPLIT_TILES == 2 and "ATOM_PDL_RELEASE" not in os.environ
    assert gemv_policy.current_policy() is policy
    assert decode_attention._pick_num_splits is pick
    assert os.environ["ATOM_PDL_KERNELS"] == "all"
    assert decode_ab.fusions_of("pdl").pdl and decode_ab.fusions_of("decode_merge").decode_merge
    assert not decode_ab.fusions_of("no_pdl").pdl
    both = decode_ab.fusions_of("pdl+decode_merge1")
    assert both.pdl and both.decode_merge
    with pytest.raises(SystemExit, match="unknown variant"):
        with decode_ab.variant("nope"):
            pass


def test_shape_matrix_selection_and_table(capsys):
    """`offline_throughput --shapes`: the named shapes (all of them when none is named),
    each a config atom builds; one table row per shape from its four measurements."""
    from benchmarks import decode_profile, model_shapes, shape_matrix

    names = decode_profile.selected_shapes([])
    assert names[:5] == ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-7b",
                         "smollm2-135m"] and len(names) == 7  # fmt: skip
    assert decode_profile.selected_shapes(None) == list(decode_profile.KERNEL_SHAPES)
    with pytest.raises(SystemExit, match="unknown shapes"):
        decode_profile.selected_shapes(["gpt-5"])
    assert model_shapes.hf_config("qwen2.5-7b").model_type == "qwen2"
    assert model_shapes.hf_config("llama-3.1-8b").intermediate_size == 14336
    step = dict(default=2.0, default_end=2.0, all_off=3.0, all_off_end=3.0)
    records = {
        label: dict(decode_ms_per_step=ms, weight_read_limit_ms=1.5, weight_bytes=6e9,
                    gemv_sites_fused=2, gemv_sites=6)
        for label, ms in step.items()
    }  # fmt: skip
    row = shape_matrix.matrix_row("llama-3.1-8b", records)
    assert row["default_tok_s"] == 500.0 and row["all_off_tok_s"] == 333.3
    assert row["default_over_all_off"] == 1.5 and row["default_of_limit"] == 0.75
    assert row["all_off_of_limit"] == 0.5 and row["gemv_sites_fused"] == "2/6"
    shape_matrix.print_matrix([row])
    assert capsys.readouterr().err.splitlines()[-1].split() == [
        "llama-3.1-8b", "500", "333", "1.500", "0.75", "0.50", "667", "2/6"
    ]  # fmt: skip

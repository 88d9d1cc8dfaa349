"""benchmarks/decode_profile.py, decode_ab.py and shape_matrix.py: their configurations,
tables and variants (no engine runs)."""

import pytest

from atom.fusions import names


def test_ablation_configurations():
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


def test_decode_ab_variants_apply_and_restore():
    """Each A/B variant changes its one choice inside its block and leaves the module
    GEMV policy and the split policy as they were after it; its fusions carry its PDL
    switch and knobs."""
    import torch

    from atom.kernels import decode_attention, gemv_policy
    from benchmarks import decode_ab

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
    with decode_ab.variant("pdl_late+no_early_kv+splits8"):
        assert not decode_attention.PDL_EARLY_KV
        assert decode_attention._pick_num_splits(q, 8, 784, 64) == 8
    assert decode_attention.PDL_EARLY_KV
    assert gemv_policy.current_policy() is policy
    assert decode_attention._pick_num_splits is pick
    assert decode_ab.fusions_of("pdl").pdl and not decode_ab.fusions_of("no_pdl").pdl
    assert decode_ab.fusions_of("pdl_small").pdl_kernels == "small"
    assert decode_ab.fusions_of("pdl_all").pdl_kernels == "all"
    both = decode_ab.fusions_of("pdl_late+splits8")
    assert both.pdl and both.pdl_release == "end" and both.pdl_kernels == "latency"
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

"""benchmarks/gemv_sweep.py at toy shapes on CPU (interpreted kernels, made-up timings)."""

import json

import torch

from atom.kernels.gemv import (
    GemvConfig,
)


def test_gemv_sweep_smoke(capsys):
    """benchmarks/gemv_sweep.py at a toy model on CPU (interpreted, two geometries):
    every layer measured against its baseline, a summary each, a table ready to paste."""
    from benchmarks import gemv_sweep

    toy = dict(hidden_size=64, intermediate_size=96, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, num_hidden_layers=2, vocab_size=160)  # fmt: skip
    args = gemv_sweep.parse_args(["--calls", "2", "--rotation-bytes", "0"])
    grid = [GemvConfig(16, 64, 4, 1), GemvConfig(64, 128, 4, 1)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        table = gemv_sweep.run_sweep(args, {"toy": toy}, "cpu", grid=grid)
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    layers = ["qkv", "qkv+norm", "o", "gate_up+silu", "gate_up+silu+norm", "down", "lm_head"]
    summaries = [r for r in records if r["case"] == "summary"]
    assert [r["layer"] for r in summaries] == layers
    measured = [r for r in records if r["case"] == "measurement" and "matches" in r]
    # the heuristic's geometry and the two of the grid, each checked against the baseline
    assert len(measured) == 3 * len(layers) and all(r["matches"] for r in measured)
    assert all(r["best_speedup"] is not None and r["best_us"] > 0 for r in summaries)
    assert (64, 128, False, False, True) in table  # qkv: 2 * 32 + 2 * 1 * 32 rows
    namespace = {}
    exec(out[out.index("GEMV_CONFIGS:") :], namespace)  # the block to paste
    assert namespace["GEMV_CONFIGS"] == table


def test_gemv_sweep_search_finds_the_fastest(monkeypatch, capsys):
    """The sweep's search (stage 1 grid, the norm layers' candidates, stage 2's stages) on a
    toy model with made-up timings (no kernels run): each layer's summary names the geometry
    the timings favour, found through the stages."""
    from benchmarks import gemv_sweep

    def fake_seconds(run, weights, calls, replays):
        config = getattr(run, "config", None)
        if config is None:
            return 1e-5  # the baseline and the heuristic
        n, k, warps, stages = config.block_n, config.block_k, config.num_warps, config.num_stages
        return 1e-6 * (1 + abs(n - 4) + abs(warps - 2) + abs(stages - 3) + (k != 128))

    def fake_triton_call(layer, inputs, config):
        baseline = gemv_sweep.baseline_call(layer, inputs)

        def run(weight):
            return baseline(weight)

        run.config = config
        return run

    monkeypatch.setattr(gemv_sweep, "seconds_per_call", fake_seconds)
    monkeypatch.setattr(gemv_sweep, "triton_call", fake_triton_call)
    toy = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, num_hidden_layers=1, vocab_size=64)  # fmt: skip
    args = gemv_sweep.parse_args(["--rotation-bytes", "0"])
    table = gemv_sweep.run_sweep(args, {"toy": toy}, "cpu")
    assert table[(256, 512, False, False, True)] == (4, 128, 2, 3)  # qkv, stage 2's 3 stages
    assert table[(256, 512, False, True, True)] == (4, 128, 2, 3)  # qkv+norm
    summaries = [json.loads(line) for line in capsys.readouterr().out.splitlines()
                 if '"summary"' in line]  # fmt: skip
    assert len(summaries) == 7 and all(r["best_speedup"] == 10.0 for r in summaries)

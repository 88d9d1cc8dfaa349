"""benchmarks/decode_attention_sweep.py at a toy shape on CPU (interpreted, made-up timings)."""

import json

import torch


def test_decode_attention_sweep_smoke(capsys):
    """The sweep's code path (its quick grid's three stages and the batch check) at a toy
    shape under the interpreter: every config checked against the reference, a summary
    per (batch, context), the table on stderr."""
    from benchmarks import decode_attention_sweep as sweep_module

    args = sweep_module.parse_args(
        ["--quick", "--contexts", "40", "300", "--batches", "1", "2", "--max-model-len", "512",
         "--calls", "1", "--rotation-bytes", "0"]
    )  # fmt: skip
    args.shapes_table = {"toy": sweep_module.Shape(4, 2, 32, 2)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sweep = sweep_module.run_sweep(args, "cpu")
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines() if line.startswith("{")]
    measured = [r for r in records if r["case"] == "measurement"]
    assert measured and all("us" in r and r["max_abs_err"] < 1e-4 for r in measured), [
        r for r in measured if "us" not in r
    ]
    summaries = [r for r in records if r["case"] == "summary"]
    assert {(r["batch"], r["context"]) for r in summaries} == {(1, 40), (1, 300), (2, 40), (2, 300)}
    assert all(r["best_us"] > 0 and r["default_us"] > 0 for r in summaries)
    labels = {r["config"] for r in measured if r["batch"] == 1 and r["context"] == 40}
    assert "default" in labels and any("skip+direct" in label for label in labels)
    assert any("cap64" in label for label in labels)
    assert "best config" in captured.err
    assert sweep.best("toy", 1, 40) in sweep.results[("toy", 1, 40)]


def test_decode_attention_sweep_stages_follow_the_best():
    """Stage 2 keeps stage 1's warps / stages, stage 3 stage 2's tile and cap; the full
    grid is the documented one (12 warps x stages, 12 tiles x caps, 15 split options)."""
    from benchmarks import decode_attention_sweep as sweep_module

    grid = sweep_module.grids(sweep_module.parse_args([]))
    assert len(sweep_module.warps_stages(grid)) == 1 + 12
    best = sweep_module.Config(num_warps=8, num_stages=2)
    tiles = sweep_module.tiles_caps(grid, best)
    assert len(tiles) == 12 and all(c.num_warps == 8 and c.num_stages == 2 for c in tiles)
    options = sweep_module.split_options(grid, tiles[0])
    assert len(options) == 15 and all(c.block_n == tiles[0].block_n for c in options)
    assert sweep_module.Config().label == "default"

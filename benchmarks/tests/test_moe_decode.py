"""benchmarks/moe_decode.py on CPU at a toy shape."""

import torch


def test_moe_decode_benchmark_runs_and_paths_agree():
    """benchmarks/moe_decode.py on CPU at a toy shape: every path reported, and the
    dense, per-expert and fused dispatch give the same output."""
    from benchmarks import moe_decode

    argv = "--device cpu --dtype float32 --layers 2 --hidden 64 --intermediate 32"
    argv += " --experts 8 --top-k 2 --shared 1 --batch 1 5 --prefill 9 --min-seconds 0"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # toy ops: a busy machine's thread pool would cost seconds
    try:
        records = moe_decode.run(moe_decode.parse_args(argv.split()))
    finally:
        torch.set_num_threads(threads)
    paths = {(r["batch"], r["path"]) for r in records}
    decode = ("dense_eager", "per_expert_eager", "fused_eager")
    assert paths == {(b, p) for b in (1, 5) for p in decode} | {
        (9, "per_expert_eager"),
        (9, "fused_eager"),
    }
    for r in records:
        assert r["ms"] > 0 and r["max_rel_err"] <= 1e-5, r
        assert 2 <= r["experts_hit_per_layer"] <= 8


def test_moe_decode_benchmark_fp8_runs_and_paths_agree():
    """``--fp8`` on CPU at a toy shape: the old dequantize-every-expert path and the layer's
    own agree (on CPU both run the reference on dequantized experts)."""
    from benchmarks import moe_decode

    argv = "--device cpu --dtype float32 --layers 2 --hidden 64 --intermediate 32 --fp8"
    argv += " --fp8-block 16 16 --experts 8 --top-k 2 --shared 1 --batch 1 5 --prefill 9"
    argv += " --min-seconds 0"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        records = moe_decode.run(moe_decode.parse_args(argv.split()))
    finally:
        torch.set_num_threads(threads)
    paths = {(r["batch"], r["path"]) for r in records}
    decode = ("dequantize_all_eager", "fused_eager")
    assert paths == {(b, p) for b in (1, 5, 9) for p in decode}
    for r in records:
        assert r["ms"] > 0 and r["max_rel_err"] <= 1e-5, r
        assert 2 <= r["experts_hit_per_layer"] <= 8
        assert (r["speedup_vs_dense"] is None) == (r["path"] == "dequantize_all_eager")

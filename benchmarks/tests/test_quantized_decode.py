"""benchmarks/quantized_decode.py on CPU at a toy shape: every mode runs and reports."""

import torch

from benchmarks import quantized_decode


def _run(argv: str) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # toy ops: a busy machine's thread pool would cost seconds
    try:
        return quantized_decode.run(quantized_decode.parse_args(argv.split()))
    finally:
        torch.set_num_threads(threads)


def test_decode_loads_each_format_through_the_quantization_package():
    records = _run("--device cpu --shape tiny --window-steps 2 --input-len 8 --output-len 24")
    assert [r["format"] for r in records] == ["bf16", "fp8", "int4"]
    for r in records:
        assert "error" not in r, r
        assert r["decode_tok_s"] > 0
    sizes = {r["format"]: r["weight_read_bytes"] for r in records}
    # fp32 on CPU: fp8 stores 1 byte and int4 half a byte per linear weight
    assert sizes["int4"] < sizes["fp8"] < sizes["bf16"]
    assert all("over_bf16" in r for r in records)


def test_kernels_mode_checks_every_kernel_against_the_dense_layer():
    records = _run("--device cpu --shape tiny --kernels --rows 1 3")
    quantized = [r for r in records if r["format"] != "bf16"]
    assert {(r["layer"], r["rows"], r["format"]) for r in quantized} == {
        (layer, rows, fmt)
        for layer in ("qkv", "o", "gate_up", "down")
        for rows in (1, 3)
        for fmt in ("fp8", "fp8_block", "int4")
    }
    for r in quantized:
        assert "error" not in r, r
        assert r["max_rel_err"] < 1e-4, r  # fp32 on CPU, against the dequantized weight
        assert r["quantization_err"] < (0.25 if r["format"] == "int4" else 0.06), r


def test_throughput_mode_runs_bf16_and_fp8():
    records = _run(
        "--device cpu --shape tiny --throughput --num-prompts 3 --max-num-seqs 4 "
        "--input-len 8 --output-len 4"
    )
    assert [r["format"] for r in records] == ["bf16", "fp8"]
    assert all("error" not in r and r["output_tok_s"] > 0 for r in records)

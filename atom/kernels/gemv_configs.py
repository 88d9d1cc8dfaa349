"""Measured launch geometries of the GEMV kernels (atom/kernels/gemv.py), per layer shape.

Key: (in_features, out_features, silu_mul, norm, single_row), out_features counting the
weight's rows (2 * intermediate for the SiLU * up epilogue; norm: the RMSNorm prologue,
with or without the residual add). Value: (BLOCK_N, BLOCK_K, num_warps, num_stages).
``gemv_config`` looks a shape up here on the GPU and falls back to its heuristic for any
shape that is missing.

Filled from the H200 sweep: run ``python3 -m atom.benchmarks.gemv_sweep`` and paste the
``GEMV_CONFIGS = {...}`` block it prints last (its `config_table` line holds the same dict)
over the one below. Only entries whose best Triton config beat the unfused cuBLAS baseline
matter for the engine (the sweep's `summary` lines say which), but a faster geometry never
hurts, so the sweep prints every measured shape.
"""

# (in_features, out_features, silu_mul, norm, single_row) -> (BLOCK_N, BLOCK_K, warps, stages)
GEMV_CONFIGS: dict[tuple[int, int, bool, bool, bool], tuple[int, int, int, int]] = {
    # PLACEHOLDER: Llama-3.2-1B shape, batch 1 (qkv, qkv+norm, o, gate_up+silu,
    # gate_up+silu+norm, down, lm_head), from the H200 sweep.
    # PLACEHOLDER: SmolLM2-135M shape, batch 1 (the same seven), from the H200 sweep.
}

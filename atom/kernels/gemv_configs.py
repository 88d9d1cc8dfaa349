"""Measured launch geometries of the one-row GEMV (atom/kernels/gemv.py), per layer shape.

Key: (in_features, out_features, silu_mul, norm, single_row), out_features counting the
weight's rows (2 * intermediate for the SiLU * up epilogue; norm: the RMSNorm folded in,
with or without the residual add; single_row: True, the only kernel there is now, kept in
the key as the sweep writes it). Value: (BLOCK_N, BLOCK_K, num_warps, num_stages).
``gemv_config`` looks a shape up here on the GPU and falls back to its heuristic for any
shape that is missing.

Filled from the H200 sweep: run ``python3 -m atom.benchmarks.gemv_sweep`` and paste the
``GEMV_CONFIGS = {...}`` block it prints last (its `config_table` line holds the same dict)
over the two below. GEMV_SLOWER lists the shapes whose best Triton geometry still lost to
the unfused cuBLAS path: there the engine keeps cuBLAS even with the fusion switch on
(`gemv_wins` in atom/kernels/gemv.py).
"""

# (in_features, out_features, silu_mul, norm, single_row) -> (BLOCK_N, BLOCK_K, warps, stages)
GEMV_CONFIGS: dict[tuple[int, int, bool, bool, bool], tuple[int, int, int, int]] = {
    (2048, 3072, False, False, True): (1, 1024, 2, 1),  # llama-3.2-1b qkv: 1.219x unfused
    (2048, 3072, False, True, True): (2, 512, 2, 1),  # llama-3.2-1b qkv+norm: 1.126x unfused
    (2048, 2048, False, False, True): (1, 1024, 2, 1),  # llama-3.2-1b o: 1.494x unfused
    (2048, 16384, True, False, True): (1, 1024, 1, 1),  # llama-3.2-1b gate_up+silu: 1.163x unfused
    (2048, 16384, True, True, True): (
        8,
        128,
        1,
        1,
    ),  # llama-3.2-1b gate_up+silu+norm: 1.018x unfused
    (8192, 2048, False, False, True): (1, 1024, 4, 1),  # llama-3.2-1b down: 1.267x unfused
    (2048, 128256, False, False, True): (1, 1024, 2, 1),  # llama-3.2-1b lm_head: 1.08x unfused
    (576, 960, False, False, True): (2, 1024, 8, 1),  # smollm2-135m qkv: 1.77x unfused
    (576, 960, False, True, True): (2, 1024, 8, 1),  # smollm2-135m qkv+norm: 2.074x unfused
    (576, 576, False, False, True): (2, 1024, 8, 1),  # smollm2-135m o: 1.726x unfused
    (576, 3072, True, False, True): (1, 1024, 1, 1),  # smollm2-135m gate_up+silu: 1.827x unfused
    (576, 3072, True, True, True): (4, 256, 4, 4),  # smollm2-135m gate_up+silu+norm: 1.849x unfused
    (1536, 576, False, False, True): (1, 2048, 4, 1),  # smollm2-135m down: 2.017x unfused
    (576, 49152, False, False, True): (4, 128, 2, 1),  # smollm2-135m lm_head: 0.974x unfused
}
# the shapes whose best Triton GEMV lost to the unfused cuBLAS path (the engine keeps that)
GEMV_SLOWER: set[tuple[int, int, bool, bool, bool]] = {
    # faster than the unfused path in the sweep (1.018x), slower in the engine: the 1B decode
    # step took 929 against 878 us of GPU with it (in-process A/B, docs/benchmarks.md)
    (2048, 16384, True, True, True),  # llama-3.2-1b gate_up+silu+norm
    (576, 49152, False, False, True),  # smollm2-135m lm_head: 0.974x unfused
}

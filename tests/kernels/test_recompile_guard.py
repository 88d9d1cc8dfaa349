"""Recompile guard: one compiled variant per kernel and geometry, whatever the lengths.

On CPU (structural): every kernel's runtime-length arguments are in do_not_specialize and
none is constexpr; every other scalar argument is a stride or a float fixed by geometry;
every Triton kernel in atom/kernels is listed here. On CUDA: each kernel runs through its
public wrapper over the length sweep (1, 16, 257, 4096, 4097, 65536 and random lengths) and
must compile exactly one variant.
"""

import importlib
import pkgutil

import pytest
import torch

import atom.kernels
from atom.kernels import (
    activation,
    argmax,
    decode_attention,
    fp8_linear,
    gdn_chunk,
    gdn_conv,
    gdn_delta_rule,
    gdn_gates,
    gemv,
    int4_linear,
    kv_cache,
    logprob_topk,
    mla,
    moe,
    moe_combine,
    moe_gemv,
    moe_routing,
    page_table,
    pdl,
    prefill_attention,
    rmsnorm,
    rope_kv_epilogue,
    rotary,
    rotary_kv,
    sampling,
    scatter,
    v4_attention,
    v4_compressor,
    v4_indexer,
    v4_mhc,
    v4_prefill_attention,
    v4_rope,
    v4_topk,
    v41_engram,
    v41_quant,
)
from tests.kernels.recompile_guard import (
    SWEEP,
    assert_one_variant,
    kernel_arguments,
    variants_over_sweep,
)

triton = pytest.importorskip("triton")

# (module, kernel): its runtime-length arguments (must be in do_not_specialize, never
# constexpr), and its other scalar arguments that geometry fixes (strides, float scales:
# Triton may specialize those; their values do not change with lengths). Anything else
# must be a pointer (named *_ptr) or a constexpr.
KERNELS = {
    (activation, "_silu_and_mul_kernel"): (["num_tokens"], ["stride_x", "stride_out"]),
    (activation, "_clamped_silu_and_mul_kernel"): (
        ["num_tokens"],
        ["stride_gate", "stride_up", "stride_out", "limit"],
    ),
    # tokens and heads come from the grid
    (activation, "_sigmoid_gate_kernel"): (
        [],
        ["stride_x", "stride_gate_token", "stride_gate_head"],
    ),
    (rmsnorm, "_rms_norm_kernel"): (
        ["num_tokens"],
        ["eps", "stride_x", "stride_residual", "stride_out", "stride_residual_out"],
    ),
    (rotary, "_rotary_kernel"): (
        ["num_tokens"],
        [
            "stride_q_token",
            "stride_q_head",
            "stride_k_token",
            "stride_k_head",
            "stride_q_out_token",
            "stride_q_out_head",
            "stride_k_out_token",
            "stride_k_out_head",
            "stride_cache_position",
        ],
    ),
    # RoPE + KV-cache write in one kernel (Fusions.rope_kv_write).
    (rotary_kv, "_rotary_kv_write_kernel"): (
        ["num_tokens"],
        [
            "stride_q_token",
            "stride_q_head",
            "stride_k_token",
            "stride_k_head",
            "stride_v_token",
            "stride_v_head",
            "stride_cache_position",
        ],
    ),
    # Greedy argmax: rows come from the grid, the vocabulary is geometry.
    (argmax, "_chunk_argmax_kernel"): ([], ["stride_logits_row"]),
    (argmax, "_rows_argmax_kernel"): ([], []),
    # The batch-1 GEMV (one row, chosen on the host): no runtime length at all; in/out
    # features are geometry passed as plain arguments (one variant serves every shape).
    (gemv, "_gemv_row_kernel"): (
        [],
        [
            "in_features",
            "out_features",
            "eps",
            "stride_weight",
            "stride_cos",
            "num_q_heads",
            "num_kv_heads",
        ],
    ),  # fmt: skip
    (kv_cache, "_store_kvcache_kernel"): (
        ["num_tokens"],
        ["stride_key_token", "stride_key_head", "stride_value_token", "stride_value_head"],
    ),
    (decode_attention, "_paged_decode_kernel"): (
        # batch, context lengths and splits come from the grid and device memory; the
        # block-table row stride is the page-table width (max context); a split's least
        # share of the context is a launch option, never a specialization.
        ["stride_block_tables_row", "min_split_tokens"],
        [
            "sm_scale",
            "stride_q_batch",
            "stride_q_head",
            "stride_cache_block",
            "stride_cache_offset",
            "stride_cache_head",
            "stride_scale_block",
            "stride_scale_offset",
            "stride_out_batch",
            "stride_out_head",
        ],
    ),
    (decode_attention, "_merge_splits_kernel"): (
        ["num_splits", "min_split_tokens"],
        ["stride_out_batch", "stride_out_head"],
    ),
    (prefill_attention, "_paged_prefill_kernel"): (
        ["stride_block_tables_row"],
        [
            "sm_scale",
            "stride_q_token",
            "stride_q_head",
            "stride_cache_block",
            "stride_cache_offset",
            "stride_cache_head",
            "stride_scale_block",
            "stride_scale_offset",
            "stride_out_token",
            "stride_out_head",
        ],
    ),
    # Every length is read from the arena's header on the device: nothing to specialize.
    (scatter, "_scatter_segments_kernel"): ([], []),
    (scatter, "_fill_placeholders_kernel"): (["num"], []),
    # Page-table maintenance: counts live in device memory; the row stride is the
    # page-table width (max context), so it is runtime like the attention kernels'.
    (page_table, "_apply_row_deltas_kernel"): (["row_stride"], []),
    (page_table, "_copy_rows_kernel"): (["src_stride", "dst_stride"], []),
    (page_table, "_slot_mapping_kernel"): (["num_tokens", "row_stride"], []),
    # MLA: the latent write, and the latent decode (lengths from the grid and device memory).
    (mla, "_store_latent_kernel"): (["num_tokens"], ["stride_latent_token"]),
    (mla, "_paged_mla_decode_kernel"): (
        ["stride_block_tables_row"],
        [
            "sm_scale",
            "stride_q_latent_batch",
            "stride_q_latent_head",
            "stride_q_rope_batch",
            "stride_q_rope_head",
            "stride_cache_block",
            "stride_out_batch",
            "stride_out_head",
        ],
    ),
    # MoE: alignment of the (token, k) pairs by expert, then the two grouped GEMMs; the
    # number of used rows is read from device memory, the rest is geometry.
    (moe, "_moe_align_kernel"): (["num_pairs"], []),
    (moe, "_moe_gate_up_kernel"): (
        ["num_pairs"],
        [
            "swiglu_limit",
            "stride_x",
            "stride_gate_up_expert",
            "stride_gate_up_row",
            "stride_out",
            "stride_scale_expert",
            "stride_scale_row",
        ],
    ),
    (moe, "_moe_down_kernel"): (
        ["num_pairs"],
        [
            "stride_hidden",
            "stride_down_expert",
            "stride_down_row",
            "stride_out",
            "stride_scale_expert",
            "stride_scale_row",
        ],
    ),
    # MoE at decode, one GEMV per (token, k) pair: the pairs come from the grid
    (moe_gemv, "_moe_gate_up_gemv_kernel"): (
        [],
        [
            "swiglu_limit",
            "stride_x",
            "stride_gate_up_expert",
            "stride_gate_up_row",
            "stride_out",
            "stride_shared_row",
        ],
    ),
    (moe_gemv, "_moe_down_gemv_kernel"): (
        [],
        [
            "stride_hidden",
            "stride_down_expert",
            "stride_down_row",
            "stride_out",
            "stride_shared_row",
        ],
    ),
    # the sum over k with the (gated) shared expert: tokens come from the grid
    (moe_combine, "_moe_combine_kernel"): ([], ["stride_pair_token", "stride_shared", "stride_x"]),
    # GDN: rows come from the grid, sequence bounds from cu_seqlens in device memory;
    # the scratch slot is the state-slot count (fixed by the engine's configuration).
    (gdn_conv, "_conv1d_update_kernel"): ([], ["stride_x", "stride_out", "scratch_slot"]),
    (gdn_conv, "_conv1d_prefill_kernel"): ([], ["stride_x", "stride_out", "scratch_slot"]),
    (gdn_conv, "_conv1d_prefill_state_kernel"): ([], ["stride_x", "scratch_slot"]),
    (gdn_delta_rule, "_gated_delta_rule_kernel"): (
        [],
        [
            "stride_q_token",
            "stride_k_token",
            "stride_v_token",
            "stride_out_token",
            "scratch_slot",
            "scale",
        ],
    ),
    # GDN's elementwise launches: tokens (and token x value head rows) come from the grid
    (gdn_gates, "_gdn_split_kernel"): ([], ["stride_qkvz", "stride_ba"]),
    (gdn_gates, "_gated_rms_norm_kernel"): ([], ["stride_z_token", "stride_z_head", "eps"]),
    # the chunked delta rule: chunk bounds are computed on the device (from cu_seqlens)
    (gdn_chunk, "_chunk_inverse_kernel"): ([], ["stride_k_token"]),
    (gdn_chunk, "_chunk_state_kernel"): (
        [],
        [
            "stride_q_token",
            "stride_k_token",
            "stride_v_token",
            "stride_out_token",
            "scratch_slot",
            "scale",
        ],
    ),
    # DeepSeek-V4: the window-ring write (rows from the grid) and the one-pass decode over
    # window + entries + sink (entry count and page-table width are runtime).
    (v4_attention, "_write_window_kernel"): (["num_rows"], ["stride_kv_row"]),
    (v4_indexer, "_index_scores_kernel"): (
        ["max_entries", "stride_tables_row"],
        ["num_blocks", "scale", "stride_q_row", "stride_q_head", "stride_weights_row"],
    ),
    # the indexer's top-k select: the scores row's width (max_model_len / ratio) and k
    (v4_topk, "_indexer_topk_kernel"): (["width", "k"], []),
    # its split form (few long rows): the slices per row and the round are runtime too
    (v4_topk, "_topk_histogram_kernel"): (["width", "k", "num_splits", "round_"], []),
    (v4_topk, "_topk_count_kernel"): (["width", "k", "num_splits"], []),
    (v4_topk, "_topk_compact_kernel"): (["width", "k", "num_splits"], []),
    # num_blocks (the pool's size) is dynamic too: it differs between engines in one process
    (v4_compressor, "_compressor_decode_kernel"): (
        ["num_rows", "stride_tables_row", "num_blocks"],
        ["eps", "stride_kv_row", "stride_gate_row", "stride_cos_row"],
    ),
    # DeepSeek-V4.1's decode store of the emitted entries (and keys): rows from the grid
    (v4_compressor, "_store_entries_decode_kernel"): (
        ["num_rows", "stride_tables_row", "num_blocks"],
        ["stride_entries_row", "stride_keys_row"],
    ),
    (v4_attention, "_v4_merge_kernel"): (["num_splits"], ["stride_out_row", "stride_out_head"]),
    (v4_attention, "_v4_decode_kernel"): (
        ["num_entries", "stride_tables_row", "num_blocks", "stride_ids_row"],
        [
            "scale",
            "stride_q_row",
            "stride_q_head",
            "stride_out_row",
            "stride_out_head",
        ],
    ),
    # DeepSeek-V4 prefill: queries from the grid; the first query's and key's positions,
    # the entry count and the id list's width (min(top-k, entries)) are runtime
    (v4_prefill_attention, "_v4_prefill_kernel"): (
        ["query_start", "key_first", "num_entries", "num_ids", "stride_ids_row"],
        [
            "scale",
            "stride_q_row",
            "stride_q_head",
            "stride_keys_row",
            "stride_entries_row",
            "stride_out_row",
            "stride_out_head",
        ],
    ),
    # DeepSeek-V4 mHC and norm + rope: tokens come from the grid; strides and eps are fixed
    (v4_mhc, "_hc_mix_partial_kernel"): ([], ["stride_streams_row"]),
    (v4_mhc, "_hc_finish_kernel"): (
        [],
        ["stride_streams_row", "stride_out_row", "mix_eps", "hc_eps", "norm_eps"],
    ),
    (v4_mhc, "_hc_post_kernel"): ([], ["stride_out_row", "stride_streams_row"]),
    (v4_mhc, "_hc_collapse_kernel"): ([], ["stride_streams_row", "stride_out_row", "norm_eps"]),
    (v4_rope, "_norm_rope_kernel"): ([], ["stride_x_row", "stride_x_head", "eps", "sign"]),
    # MoE routing (V4, softmax): tokens come from the grid; the scaling factor is the model's
    (moe_routing, "_route_kernel"): ([], ["stride_logits_row", "scale", "temperature"]),
    # DeepSeek-V4.1: fake quantisation (number of quantisation blocks) and Engram hashing.
    (v41_quant, "_fake_quant_kernel"): (["num_blocks"], []),
    (v41_engram, "_engram_hash_kernel"): (["num_tokens"], []),
    # Sampling options and logprobs: rows come from the grid; the vocabulary, the state's
    # bias / stop table widths, the logprob count k and the logits' row stride are runtime.
    (sampling, "_sampling_pass_kernel"): (
        ["logits_stride", "bias_width", "stop_width", "vocab_size", "num_blocks", "sub_width"],
        [],
    ),
    (sampling, "_count_sampled_kernel"): (["vocab_size"], []),
    (sampling, "_count_greater_kernel"): (["vocab_size", "logits_stride", "num_blocks"], []),
    (fp8_linear, "_fp8_gemv_kernel"): (
        [],
        ["in_features", "out_features", "stride_weight", "stride_scale", "scale_rows"],
    ),
    (fp8_linear, "_fp8_dot_kernel"): (
        ["num_rows"],
        [
            "in_features",
            "out_features",
            "stride_x",
            "stride_out",
            "stride_weight",
            "stride_scale",
            "scale_rows",
        ],
    ),  # fmt: skip
    (fp8_linear, "_quantize_rows_kernel"): (["num_rows"], ["in_features", "stride_x"]),
    (int4_linear, "_int4_gemv_kernel"): (
        [],
        ["in_words", "out_features", "words_per_split", "stride_words", "stride_scale"],
    ),
    (int4_linear, "_int4_split_sum_kernel"): ([], ["splits", "out_features"]),
    (int4_linear, "_denormal_probe_kernel"): ([], []),
    (int4_linear, "_int4_dot_kernel"): (
        ["num_rows"],
        [
            "in_words",
            "out_features",
            "stride_x",
            "stride_out",
            "stride_words",
            "stride_scale",
            "group_words",
        ],
    ),  # fmt: skip
    (logprob_topk, "_select_topk_kernel"): (
        ["logits_stride", "vocab_size", "num_blocks", "sub_width", "k"],
        [],
    ),
}
# pointer arguments not named *_ptr: the scatter kernel's arenas, the page-table kernels'
POINTERS = {"src", "dst", "rows", "buffer", "positions", "cu_seqlens", "context_lens", "out"}
# @triton.jit helpers called from kernels (inlined: no launch, no specialization).
DEVICE_FUNCTIONS = {
    (rotary, "_rotate_heads"),
    (rotary_kv, "_write_halves"),
    (decode_attention, "_decode_split"),
    (decode_attention, "_split_tokens"),
    (rope_kv_epilogue, "_rope_kv_epilogue"),
    (gemv, "_x_chunk"),
    (gemv, "_weight_chunk"),
    (pdl, "pdl_wait_and_release"),
    (pdl, "pdl_release"),
    (kv_cache, "_e4m3_bits"),
    (kv_cache, "_quantize_rows"),
    (v4_attention, "_online_update"),
    (v4_topk, "_ordered_bits"),
    (v4_topk, "_chunk_bits"),
    (v4_topk, "_slice_bounds"),
    (v4_topk, "_radix_state"),
    (v4_compressor, "pool_offsets"),
    (v4_compressor, "_store_entry_row"),
    (v4_mhc, "_split_tile"),
    (v4_mhc, "_stream_rows"),
    (moe_gemv, "_pair"),
    (v4_mhc, "_collapse_norm"),
    (v4_rope, "_weighted"),
    (v41_quant, "_exponent"),
    (v41_quant, "_round_half_even"),
    (v41_quant, "_e4m3"),
    (v41_quant, "_pow2_ceil"),
    (v41_quant, "_e2m1"),
    (logprob_topk, "_order_key"),
    (logprob_topk, "_ordered_u32"),
}


def _is_triton_function(obj) -> bool:
    return type(obj).__name__ in ("JITFunction", "InterpretedFunction") and hasattr(obj, "fn")


def test_every_kernel_in_atom_kernels_is_listed():
    found = set()
    for info in pkgutil.iter_modules(atom.kernels.__path__):
        module = importlib.import_module(f"atom.kernels.{info.name}")
        for name, obj in vars(module).items():
            if _is_triton_function(obj) and obj.fn.__module__ == module.__name__:
                found.add((module.__name__, name))
    listed = {(m.__name__, n) for m, n in (*KERNELS, *DEVICE_FUNCTIONS)}
    assert found == listed, (
        f"unlisted: {sorted(found - listed)}; gone: {sorted(listed - found)} "
        "(add new kernels to KERNELS with their runtime-length arguments)"
    )


@pytest.mark.parametrize(
    "module, name", list(KERNELS), ids=[f"{m.__name__.split('.')[-1]}.{n}" for m, n in KERNELS]
)
def test_runtime_lengths_are_dynamic_and_other_scalars_fixed(module, name):
    runtime, fixed = KERNELS[module, name]
    names, dns, constexpr = kernel_arguments(getattr(module, name))
    for arg in runtime:
        assert arg in names, f"{name} has no argument {arg}"
        assert arg in dns, f"{name}: runtime length {arg} is not in do_not_specialize"
        assert arg not in constexpr, f"{name}: runtime length {arg} is constexpr"
    assert dns <= set(runtime), f"{name}: unexpected do_not_specialize {dns - set(runtime)}"
    for arg in names:
        if arg in constexpr or arg in runtime or arg in fixed:
            continue
        assert arg.endswith("_ptr") or arg in POINTERS, (
            f"{name}: scalar argument {arg} is neither a runtime length (do_not_specialize) "
            "nor a stride/scale fixed by geometry; list it in KERNELS"
        )
    for arg in fixed:
        assert arg in names and arg not in constexpr, f"{name}: {arg}"


# -- on the GPU: one compiled variant over the sweep -----------------------------------------

DEVICE = "cuda"
BF16 = torch.bfloat16


def _generator():
    return torch.Generator(DEVICE).manual_seed(0)


@pytest.mark.gpu
def test_silu_and_mul_one_variant():
    intermediate = 2048
    x = torch.randn(max(SWEEP), 2 * intermediate, device=DEVICE, dtype=BF16)
    assert_one_variant(
        activation, ["_silu_and_mul_kernel"], lambda n: activation.silu_and_mul(x[:n])
    )


@pytest.mark.gpu
def test_clamped_silu_and_mul_one_variant():
    intermediate = 2048
    x = torch.randn(max(SWEEP), 2 * intermediate, device=DEVICE, dtype=BF16)
    assert_one_variant(
        activation,
        ["_clamped_silu_and_mul_kernel"],
        lambda n: activation.clamped_silu_and_mul(x[:n, :intermediate], x[:n, intermediate:], 10.0),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_one_variant(with_residual):
    hidden = 2048
    x = torch.randn(max(SWEEP), hidden, device=DEVICE, dtype=BF16)
    residual = torch.randn_like(x)
    weight = torch.ones(hidden, device=DEVICE, dtype=BF16)

    def run(n):
        rmsnorm.rms_norm(x[:n], weight, 1e-6, residual[:n] if with_residual else None)

    assert_one_variant(rmsnorm, ["_rms_norm_kernel"], run)


@pytest.mark.gpu
def test_rotary_one_variant():
    num_q_heads, num_kv_heads, head_dim, max_position = 32, 8, 64, 8192
    qkv = torch.randn(
        max(SWEEP), (num_q_heads + 2 * num_kv_heads) * head_dim, device=DEVICE, dtype=BF16
    )
    q = qkv[:, : num_q_heads * head_dim].view(-1, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim]
    k = k.view(-1, num_kv_heads, head_dim)
    cos = torch.rand(max_position, head_dim, device=DEVICE)
    sin = torch.rand(max_position, head_dim, device=DEVICE)
    positions = torch.randint(0, max_position, (max(SWEEP),), device=DEVICE)
    assert_one_variant(
        rotary,
        ["_rotary_kernel"],
        lambda n: rotary.apply_rotary(positions[:n], q[:n], k[:n], cos, sin),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_store_kvcache_one_variant(kv_cache_dtype):
    num_kv_heads, head_dim, block_size = 8, 128, 16
    longest = max(SWEEP)
    qkv = torch.randn(longest, 3 * num_kv_heads, head_dim, device=DEVICE, dtype=BF16)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    num_blocks = longest // block_size + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    scales = {}
    if kv_cache_dtype == "fp8":
        cache_dtype = kv_cache.FP8_DTYPE
        scales = {
            "k_scale": torch.zeros(shape[:3], device=DEVICE),
            "v_scale": torch.zeros(shape[:3], device=DEVICE),
        }
    else:
        cache_dtype = BF16
    k_cache = torch.zeros(shape, device=DEVICE, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE, generator=_generator())
    slots[::7] = -1

    def run(n):
        kv_cache.store_kvcache(key[:n], value[:n], k_cache, v_cache, slots[:n], **scales)

    assert_one_variant(kv_cache, ["_store_kvcache_kernel"], run)


def _paged_cache(kv_cache_dtype, num_blocks=4096, block_size=16, num_kv_heads=8, head_dim=128):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEVICE, dtype=BF16)
    v_cache = torch.randn(shape, device=DEVICE, dtype=BF16)
    if kv_cache_dtype == "auto":
        return k_cache, v_cache, {}
    k_fp8, k_scale = kv_cache.quantize_fp8_reference(k_cache)
    v_fp8, v_scale = kv_cache.quantize_fp8_reference(v_cache)
    return k_fp8, v_fp8, {"k_scale": k_scale, "v_scale": v_scale}


def _block_tables(rows, context, num_blocks, block_size=16):
    """Random (aliased, read-only) block ids: enough columns for ``context`` tokens."""
    columns = -(-context // block_size) + 1
    return torch.randint(
        0, num_blocks, (rows, columns), device=DEVICE, dtype=torch.int32, generator=_generator()
    )


# paged_decode_attention's launch knobs and split options (a launch's constants: one variant
# each); "sweep" marks min_split_tokens swept with the lengths (a runtime value).
DECODE_OPTIONS = {
    "default": {},
    "knobs": dict(block_n=32, num_warps=2, num_stages=2, max_splits=128),
    "skip_direct": dict(skip_empty_splits=True, single_split_direct=True),
    "min_tokens_swept": dict(min_split_tokens="sweep", skip_empty_splits=True),
    "min_tokens_direct": dict(min_split_tokens="sweep", single_split_direct=True, block_n=128),
}


@pytest.mark.gpu
@pytest.mark.parametrize("options", list(DECODE_OPTIONS.values()), ids=list(DECODE_OPTIONS))
@pytest.mark.parametrize("early_kv", [False, True])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_paged_decode_one_variant(kv_cache_dtype, early_kv, options):
    """Batch sizes (short contexts, no split) and context lengths (batch 3, split) swept:
    the split count, the grid and the block-table width all change. ``early_kv`` (a
    layer's constant: cached K / V before the PDL wait, PDL on by default) as well, and
    each option of the launch (min_split_tokens, a runtime value, swept with the lengths)."""
    num_q_heads, head_dim, num_blocks = 32, 128, 4096  # 8 kv heads (_paged_cache)
    k_cache, v_cache, scales = _paged_cache(kv_cache_dtype, num_blocks)
    scales = dict(scales, early_kv=early_kv)
    q = torch.randn(max(SWEEP), num_q_heads, head_dim, device=DEVICE, dtype=BF16)
    generator = _generator()

    def run(n):
        knobs = {k: (n if v == "sweep" else v) for k, v in options.items()}
        # n sequences of 1..64 tokens
        lens = torch.randint(1, 65, (n,), device=DEVICE, dtype=torch.int32, generator=generator)
        tables = _block_tables(n, 64, num_blocks)
        decode_attention.paged_decode_attention(
            q[:n], k_cache, v_cache, tables, lens, head_dim**-0.5, **scales, **knobs
        )
        # 3 sequences, the longest n tokens
        lens = torch.tensor([n, n // 2 + 1, 1], device=DEVICE, dtype=torch.int32)
        tables = _block_tables(3, n, num_blocks)
        decode_attention.paged_decode_attention(
            q[:3], k_cache, v_cache, tables, lens, head_dim**-0.5, **scales, **knobs
        )

    assert_one_variant(decode_attention, ["_paged_decode_kernel", "_merge_splits_kernel"], run)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_rotary_kv_write_one_variant(kv_cache_dtype):
    num_q_heads, num_kv_heads, head_dim, block_size, max_position = 32, 8, 64, 16, 8192
    longest = max(SWEEP)
    qkv = torch.randn(longest, (num_q_heads + 2 * num_kv_heads) * head_dim, device=DEVICE,
                      dtype=BF16)  # fmt: skip
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)  # fmt: skip
    q = q.view(-1, num_q_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.view(-1, num_kv_heads, head_dim)
    cos = torch.rand(max_position, head_dim, device=DEVICE)
    sin = torch.rand(max_position, head_dim, device=DEVICE)
    positions = torch.randint(0, max_position, (longest,), device=DEVICE)
    num_blocks = longest // block_size + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    scales = {}
    cache_dtype = BF16
    if kv_cache_dtype == "fp8":
        cache_dtype = kv_cache.FP8_DTYPE
        scales = {
            "k_scale": torch.zeros(shape[:3], device=DEVICE),
            "v_scale": torch.zeros(shape[:3], device=DEVICE),
        }
    k_cache = torch.zeros(shape, device=DEVICE, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE, generator=_generator())
    slots[::7] = -1

    def run(n):
        rotary_kv.rotary_kv_write(
            positions[:n], q[:n], k[:n], v[:n], cos, sin, k_cache, v_cache, slots[:n], **scales
        )

    assert_one_variant(rotary_kv, ["_rotary_kv_write_kernel"], run)


def _row_scaled_fp8(rows, cols):
    """An e4m3 weight [rows, cols] and its float32 scale per row (the fused GEMVs' FP8)."""
    weight = torch.randn(rows, cols, device=DEVICE).to(torch.float8_e4m3fn)
    return weight, torch.rand(rows, 1, device=DEVICE) / 448 + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_one_variant(silu_mul, fp8):
    """One row compiles one variant (with and without the norm; a bf16 or an FP8 weight
    with its scale per row); more rows take the torch path and compile nothing."""
    x = torch.randn(16, 2048, device=DEVICE, dtype=BF16)
    weight, scale = torch.randn(16384, 2048, device=DEVICE, dtype=BF16), None
    if fp8:
        weight, scale = _row_scaled_fp8(16384, 2048)
    lengths = [1, 2, 3, 7, 16]
    kernels = ["_gemv_row_kernel"]

    def plain(n):
        if silu_mul:
            gemv.gemv_silu_and_mul(x[:n], weight, weight_scale=scale)
        else:
            gemv.gemv(x[:n], weight, weight_scale=scale)

    assert_one_variant(gemv, kernels, plain, lengths)
    residual = torch.randn_like(x)
    norm_weight = torch.ones(2048, device=DEVICE, dtype=BF16)

    def with_norm(n):
        gemv.gemv_rms_norm(
            x[:n], residual[:n], norm_weight, 1e-5, weight, silu_mul, weight_scale=scale
        )

    assert_one_variant(gemv, kernels, with_norm, lengths)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bandwidth-bound", "latency-bound"])
def test_gemv_one_row_one_variant_over_shapes(weights):
    """The batch-1 kernel's in/out features are plain arguments: the layer shapes of both
    models (multiples of 16) share one compiled variant per configuration. Whether the
    GEMV takes part in programmatic dependent launch follows its weight's size (PDL,
    atom/kernels/pdl.py: on by default), so each class of shapes is one variant."""
    config = gemv.GemvConfig(4, 512, 4, 2)
    shapes = {
        "bandwidth-bound": [(2048, 3072), (2048, 4096), (8192, 2048)],  # > 10 MB of bf16
        "latency-bound": [(576, 960), (576, 576), (1536, 576)],
    }[weights]
    for in_features, out_features in shapes:
        pdl_on = 2 * in_features * out_features <= pdl.PDL_GEMV_BYTES
        assert pdl_on == (weights == "latency-bound")

    def run(i):
        in_features, out_features = shapes[i % len(shapes)]
        x = torch.randn(1, in_features, device=DEVICE, dtype=BF16)
        weight = torch.randn(out_features, in_features, device=DEVICE, dtype=BF16)
        gemv.gemv(x, weight, config)

    assert_one_variant(gemv, ["_gemv_row_kernel"], run, range(len(shapes)))


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bandwidth-bound", "latency-bound"])
def test_gemv_fp8_one_row_one_variant_over_shapes(weights):
    """The FP8 weight (a scale per row) of the batch-1 kernel: one variant per
    configuration over the 8B and small layer shapes, with the norm and the SiLU epilogue
    (the gate_up site) and without (PDL follows the fp8 bytes: one class each)."""
    config = gemv.GemvConfig(4, 1024, 4, 2)
    shapes = {
        "bandwidth-bound": [(4096, 6144), (4096, 4096), (4096, 28672)],  # > 10 MB of fp8
        "latency-bound": [(576, 960), (576, 576), (576, 3072)],
    }[weights]
    for in_features, out_features in shapes:
        pdl_on = in_features * out_features <= pdl.PDL_GEMV_BYTES
        assert pdl_on == (weights == "latency-bound")

    def run(i):
        in_features, out_features = shapes[i % len(shapes)]
        x = torch.randn(1, in_features, device=DEVICE, dtype=BF16)
        weight, scale = _row_scaled_fp8(out_features, in_features)
        if i < len(shapes):
            gemv.gemv(x, weight, config, weight_scale=scale)
        else:
            norm_weight = torch.ones(in_features, device=DEVICE, dtype=BF16)
            gemv.gemv_rms_norm(
                x, torch.randn_like(x), norm_weight, 1e-5, weight, True, config,
                weight_scale=scale,
            )  # fmt: skip

    assert_one_variant(gemv, ["_gemv_row_kernel"], run, range(len(shapes)))
    assert_one_variant(gemv, ["_gemv_row_kernel"], run, range(len(shapes), 2 * len(shapes)))


@pytest.mark.gpu
def test_greedy_argmax_one_variant():
    logits = torch.randn(4097, 128256, device=DEVICE, dtype=BF16)
    lengths = [n for n in SWEEP if n <= 4097]
    assert_one_variant(
        argmax,
        ["_chunk_argmax_kernel", "_rows_argmax_kernel"],
        lambda n: argmax.greedy_argmax(logits[:n]),
        lengths,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_paged_prefill_one_variant(kv_cache_dtype):
    """n new tokens in chunks of at most 2048 behind a cached prefix, plus a decode row."""
    num_q_heads, head_dim, num_blocks = 32, 128, 4096  # 8 kv heads (_paged_cache)
    k_cache, v_cache, scales = _paged_cache(kv_cache_dtype, num_blocks)
    q = torch.randn(max(SWEEP) + 1, num_q_heads, head_dim, device=DEVICE, dtype=BF16)

    def run(n):
        q_lens = [min(2048, n - start) for start in range(0, n, 2048)] + [1]
        prefix = (n * 7) % 300
        context_lens = [q_len + prefix for q_len in q_lens]
        cu_seqlens = torch.tensor([0, *q_lens], device=DEVICE).cumsum(0).to(torch.int32)
        lens = torch.tensor(context_lens, device=DEVICE, dtype=torch.int32)
        tables = _block_tables(len(q_lens), max(context_lens), num_blocks)
        prefill_attention.paged_prefill_attention(
            q[: n + 1],
            k_cache,
            v_cache,
            tables,
            cu_seqlens,
            lens,
            head_dim**-0.5,
            max(q_lens),
            **scales,
        )

    assert_one_variant(prefill_attention, ["_paged_prefill_kernel"], run)


@pytest.mark.gpu
def test_scatter_one_variant():
    import numpy as np

    max_segments = 8
    src = torch.zeros(4 * max(SWEEP) + 4096, dtype=torch.uint8, device=DEVICE)
    dst = torch.zeros(4 * max(SWEEP) + 4096, dtype=torch.uint8, device=DEVICE)

    def run(n):
        header = np.zeros(scatter.HEADER_WORDS + 3 * max_segments, dtype=np.int64)
        header[0] = 1
        header[scatter.HEADER_WORDS : scatter.HEADER_WORDS + 3] = (1024, 0, 4 * n)
        src[: header.nbytes] = torch.from_numpy(header.view(np.uint8)).to(DEVICE)
        scatter.scatter_segments(src, dst, max_segments)

    assert_one_variant(scatter, ["_scatter_segments_kernel"], run)


@pytest.mark.gpu
def test_fill_placeholders_one_variant():
    ids = torch.zeros(max(SWEEP), dtype=torch.int64, device=DEVICE)
    rows = torch.arange(max(SWEEP), dtype=torch.int32, device=DEVICE)
    tokens = torch.arange(max(SWEEP), dtype=torch.int64, device=DEVICE)

    def run(n):
        scatter.fill_placeholders(ids, rows[:n], rows[:n], tokens)

    assert_one_variant(scatter, ["_fill_placeholders_kernel"], run)


@pytest.mark.gpu
def test_guard_sees_the_variants_of_a_specializing_copy():
    """The guard's counting works: without do_not_specialize the store kernel compiles a
    variant for n == 1, one for multiples of 16 and one for the rest (3 on Triton 3.6)."""
    num_kv_heads, head_dim = 2, 64
    key = torch.randn(max(SWEEP), num_kv_heads, head_dim, device=DEVICE, dtype=BF16)
    k_cache = torch.zeros(max(SWEEP), 1, num_kv_heads, head_dim, device=DEVICE, dtype=BF16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(max(SWEEP), device=DEVICE)

    def run(n):
        kv_cache.store_kvcache(key[:n], key[:n], k_cache, v_cache, slots[:n])

    history = variants_over_sweep(kv_cache, ["_store_kvcache_kernel"], run, dynamic=False)
    counts = history["_store_kvcache_kernel"]
    assert counts[-1] >= 2, counts
    assert counts[0] == 1  # n == 1 alone compiled one variant


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_slot_mapping_one_variant(mode):
    longest = max(SWEEP)
    rows = torch.randint(0, 1000, (longest, 8), device=DEVICE, dtype=torch.int32)
    positions = torch.randint(0, 8 * 16, (longest,), device=DEVICE)
    context_lens = torch.ones(longest, device=DEVICE, dtype=torch.int32)
    cu_seqlens = torch.arange(longest + 1, device=DEVICE, dtype=torch.int32)  # 1 token/row
    out = torch.empty(longest, device=DEVICE, dtype=torch.int64)

    def run(n):
        cu = cu_seqlens if mode == "prefill" else None
        page_table.derive_slot_mapping(rows, positions, cu, context_lens, out, n, n, 16)

    assert_one_variant(page_table, ["_slot_mapping_kernel"], run)


@pytest.mark.gpu
def test_page_table_deltas_and_moves_one_variant():
    longest = max(SWEEP)
    table = torch.zeros(longest, 64, device=DEVICE, dtype=torch.int32)
    scratch = torch.zeros_like(table)

    def deltas(n):
        ids = torch.arange(n, dtype=torch.int32)
        buffer = torch.cat(
            [torch.tensor([n]), ids, torch.zeros(n, dtype=torch.int32), torch.arange(n + 1), ids]
        )
        page_table.apply_row_deltas(table, buffer.to(torch.int32).to(DEVICE), n)

    def moves(n):
        ids = torch.arange(n, dtype=torch.int32)
        buffer = torch.cat([torch.tensor([n]), ids, ids.flip(0), torch.ones(n, dtype=torch.int32)])
        page_table.move_rows(table, scratch, buffer.to(torch.int32).to(DEVICE), n)

    assert_one_variant(page_table, ["_apply_row_deltas_kernel"], deltas)
    # two geometries (GATHER into the scratch table, then out of it), both at the first length
    counts = variants_over_sweep(page_table, ["_copy_rows_kernel"], moves)["_copy_rows_kernel"]
    assert counts[0] == counts[-1] == 2, counts


@pytest.mark.gpu
def test_store_latent_one_variant():
    latent_dim, block_size = 576, 16
    longest = max(SWEEP)
    wide = torch.randn(longest, latent_dim + 64, device=DEVICE, dtype=BF16)
    latent = wide[:, :latent_dim]
    cache = torch.zeros(
        longest // block_size + 2, block_size, latent_dim, device=DEVICE, dtype=BF16
    )
    slots = torch.randperm(cache.shape[0] * block_size, device=DEVICE, generator=_generator())
    slots[::7] = -1

    def run(n):
        mla.store_latent_cache(latent[:n], cache, slots[:n])

    assert_one_variant(mla, ["_store_latent_kernel"], run)


@pytest.mark.gpu
def test_paged_mla_decode_one_variant():
    """Batch sizes (short contexts) and context lengths (batch 3) swept: the grid, the
    lengths and the block-table width all change."""
    num_heads, rank, rope_dim, num_blocks, block_size = 16, 512, 64, 4096, 16
    cache = torch.randn(num_blocks, block_size, rank + rope_dim, device=DEVICE, dtype=BF16)
    q_latent = torch.randn(max(SWEEP), num_heads, rank, device=DEVICE, dtype=BF16)
    q_rope = torch.randn(max(SWEEP), num_heads, rope_dim, device=DEVICE, dtype=BF16)
    generator = _generator()
    scale = (128 + rope_dim) ** -0.5

    def run(n):
        lens = torch.randint(1, 65, (n,), device=DEVICE, dtype=torch.int32, generator=generator)
        tables = _block_tables(n, 64, num_blocks)
        mla.paged_mla_decode(q_latent[:n], q_rope[:n], cache, tables, lens, scale)
        lens = torch.tensor([n, n // 2 + 1, 1], device=DEVICE, dtype=torch.int32)
        tables = _block_tables(3, n, num_blocks)
        mla.paged_mla_decode(q_latent[:3], q_rope[:3], cache, tables, lens, scale)

    assert_one_variant(mla, ["_paged_mla_decode_kernel"], run)


def _moe_inputs(num_tokens, num_experts=16, top_k=4, hidden=256, intermediate=128):
    generator = _generator()
    scores = torch.rand(num_tokens, num_experts, device=DEVICE, generator=generator)
    weights, ids = scores.topk(top_k, dim=-1)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=BF16, generator=generator)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, device=DEVICE, dtype=BF16)
    down = torch.randn(num_experts, hidden, intermediate, device=DEVICE, dtype=BF16)
    return x, weights, ids, gate_up, down


@pytest.mark.gpu
@pytest.mark.parametrize("swiglu_limit", [None, 10.0])
def test_fused_moe_one_variant(swiglu_limit):
    """Fixed tiles: one variant of each grouped GEMM over the token sweep, and one of the
    align kernel per geometry `moe.align_geometry` picks (small and large pair counts)."""
    x, weights, ids, gate_up, down = _moe_inputs(max(SWEEP))
    tiles = moe.MoeTiles(16, 64, 64)

    def run(n):
        moe.fused_moe(x[:n], weights[:n], ids[:n], gate_up, down, swiglu_limit, tiles=tiles)

    kernels = ["_moe_align_kernel", "_moe_gate_up_kernel", "_moe_down_kernel"]
    history = variants_over_sweep(moe, kernels, run)
    align = len({moe.align_geometry(n * ids.shape[1]) for n in SWEEP})
    assert align == 2
    expected = {"_moe_align_kernel": align, "_moe_gate_up_kernel": 1, "_moe_down_kernel": 1}
    assert {name: counts[-1] for name, counts in history.items()} == expected, history


@pytest.mark.gpu
@pytest.mark.parametrize("weight_before_down", [False, True])
def test_fused_moe_fp8_one_variant(weight_before_down):
    """FP8 experts with 128 x 128 block scales (DeepSeek-V3's layout), fixed tiles: one
    variant of each grouped GEMM over the token sweep, as for bf16 weights."""
    x, weights, ids, gate_up, down = _moe_inputs(max(SWEEP))
    num_experts, hidden, intermediate = down.shape
    gate_up, down = gate_up.to(torch.float8_e4m3fn), down.to(torch.float8_e4m3fn)
    scales = moe.Fp8Scales(
        torch.rand(num_experts, 2 * intermediate // 128, hidden // 128, device=DEVICE),
        torch.rand(num_experts, hidden // 128, intermediate // 128, device=DEVICE),
        (128, 128),
        (128, 128),
    )
    tiles = moe.MoeTiles(16, 64, 64)

    def run(n):
        moe.fused_moe(x[:n], weights[:n], ids[:n], gate_up, down, tiles=tiles, fp8_scales=scales,
                      weight_before_down=weight_before_down)  # fmt: skip

    kernels = ["_moe_gate_up_kernel", "_moe_down_kernel"]
    history = variants_over_sweep(moe, kernels, run)
    assert {name: counts[-1] for name, counts in history.items()} == dict.fromkeys(kernels, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("swiglu_limit", [None, 10.0])
def test_fused_moe_decode_gemv_one_variant(monkeypatch, swiglu_limit):
    """The per-pair GEMVs (forced at every length: the pairs are the grid) and the default
    rule, which runs them at the sweep's short lengths only: one variant each."""
    x, weights, ids, gate_up, down = _moe_inputs(max(SWEEP))
    kernels = ["_moe_gate_up_gemv_kernel", "_moe_down_gemv_kernel"]

    def run(n):
        moe.fused_moe(x[:n], weights[:n], ids[:n], gate_up, down, swiglu_limit)

    assert_one_variant(moe_gemv, kernels, run)
    monkeypatch.setattr(moe, "DECODE_GEMV_OVERRIDE", True)
    assert_one_variant(moe_gemv, kernels, run)
    # the shared expert as one more pair a token: one more variant of each, for every length
    intermediate = down.shape[2]
    halves = (gate_up[0, :intermediate], gate_up[0, intermediate:], down[0])
    shared = moe.SharedExpert(lambda t: torch.zeros_like(t), halves)

    def run_shared(n):
        moe.fused_moe(x[:n], weights[:n], ids[:n], gate_up, down, swiglu_limit,
                      shared_expert=shared)  # fmt: skip

    assert_one_variant(moe_gemv, kernels, run_shared)


@pytest.mark.gpu
def test_moe_combine_one_variant():
    """Tokens (the grid) swept with and without the shared expert's gate."""
    top_k, hidden = 10, 256
    per_pair = torch.randn(max(SWEEP), top_k, hidden, device=DEVICE, dtype=BF16)
    shared, x = torch.randn(2, max(SWEEP), hidden, device=DEVICE, dtype=BF16).unbind(0)
    gate = torch.randn(1, hidden, device=DEVICE, dtype=BF16)

    def run(n):
        moe_combine.moe_combine(per_pair[:n], shared[:n], x[:n], gate)
        moe_combine.moe_combine(per_pair[:n], shared[:n], x[:n])

    history = variants_over_sweep(moe_combine, ["_moe_combine_kernel"], run)
    assert history["_moe_combine_kernel"] == [2] * len(SWEEP), history


@pytest.mark.gpu
def test_fused_moe_default_tiles_one_variant_per_tile_choice(monkeypatch):
    """The default tiles change with pairs per expert (decode vs prefill): one variant of
    each GEMM per distinct choice, nothing more (the grouped GEMMs at every length)."""
    monkeypatch.setattr(moe, "DECODE_GEMV_OVERRIDE", False)
    x, weights, ids, gate_up, down = _moe_inputs(max(SWEEP))
    num_experts, top_k = gate_up.shape[0], ids.shape[1]
    choices = len({moe.default_tiles(n * top_k, num_experts) for n in SWEEP})
    assert choices > 1

    def run(n):
        moe.fused_moe(x[:n], weights[:n], ids[:n], gate_up, down)

    kernels = ["_moe_gate_up_kernel", "_moe_down_kernel"]
    history = variants_over_sweep(moe, kernels, run)
    assert {name: counts[-1] for name, counts in history.items()} == dict.fromkeys(kernels, choices)


@pytest.mark.gpu
def test_sigmoid_gate_one_variant():
    heads, dim = 16, 256
    q_gate = torch.randn(max(SWEEP), heads, 2 * dim, device=DEVICE, dtype=BF16)
    x = torch.randn(max(SWEEP), heads * dim, device=DEVICE, dtype=BF16)

    def run(n):
        activation.sigmoid_gate(x[:n], q_gate[:n, :, dim:])

    assert_one_variant(activation, ["_sigmoid_gate_kernel"], run)


@pytest.mark.gpu
def test_gdn_gates_one_variant():
    """The split and the gated norm over n tokens: the grid changes, never the variant."""
    hk, ratio, dk, dv = 16, 2, 128, 128
    width = hk * (2 * dk + 2 * ratio * dv)
    qkvz = torch.randn(max(SWEEP), width, device=DEVICE, dtype=BF16)
    ba = torch.randn(max(SWEEP), 2 * hk * ratio, device=DEVICE, dtype=BF16)
    a_log, dt_bias = torch.randn(2, hk * ratio, device=DEVICE, dtype=BF16).unbind(0)
    x = torch.randn(max(SWEEP), hk * ratio, dv, device=DEVICE, dtype=BF16)
    z = qkvz.view(max(SWEEP), hk, -1)[..., 2 * dk + ratio * dv :].unflatten(-1, (ratio, dv))
    weight = torch.randn(dv, device=DEVICE, dtype=BF16)

    def run(n):
        gdn_gates.gdn_split(qkvz[:n], ba[:n], a_log, dt_bias, hk, dk, dv)
        gdn_gates.gated_rms_norm(x[:n], z[:n], weight, 1e-6)

    assert_one_variant(gdn_gates, ["_gdn_split_kernel", "_gated_rms_norm_kernel"], run)


@pytest.mark.gpu
def test_gdn_kernels_one_variant():
    """Decode over n rows and a prefill of n tokens (chunks of at most 2048 plus a 1-token
    row): the grid, the sequence bounds and the slots change, never the variant."""
    hk, hv, dk, dv, width, slots_count = 2, 4, 128, 128, 4, 8
    channels = 2 * hk * dk + hv * dv
    longest = max(SWEEP) + 1
    x = torch.randn(longest, channels, device=DEVICE, dtype=BF16)
    weight = torch.randn(channels, width, device=DEVICE, dtype=BF16)
    conv_state = torch.zeros(slots_count + 1, width - 1, channels, device=DEVICE, dtype=BF16)
    state = torch.zeros(slots_count + 1, hv, dk, dv, device=DEVICE)
    q = x[:, : hk * dk].view(-1, hk, dk)
    k = x[:, hk * dk : 2 * hk * dk].view(-1, hk, dk)
    v = x[:, 2 * hk * dk :].view(-1, hv, dv)
    g = -torch.rand(longest, hv, device=DEVICE)
    beta = torch.rand(longest, hv, device=DEVICE)
    rows = torch.arange(longest, device=DEVICE, dtype=torch.int32) % (slots_count + 1) - 1
    fresh = (torch.arange(longest, device=DEVICE, dtype=torch.int32) % 3 == 0).int()

    def run(n):
        gdn_conv.causal_conv1d_update(x[:n], conv_state, weight, rows[:n], fresh[:n])
        lens = [min(2048, n - s) for s in range(0, n, 2048)][: slots_count - 1] + [1]
        cu = torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
        count = len(lens)
        gdn_conv.causal_conv1d_prefill(x, conv_state, weight, cu, rows[:count], fresh[:count])

    conv_kernels = [
        "_conv1d_update_kernel",
        "_conv1d_prefill_kernel",
        "_conv1d_prefill_state_kernel",
    ]
    assert_one_variant(gdn_conv, conv_kernels, run)

    # one variant per geometry: the delta-rule kernel serves decode (one token a row) and
    # varlen prefill (VARLEN constexpr), so each form is swept on its own
    def run_decode(n):
        gdn_delta_rule.recurrent_gated_delta_rule(
            q[:n], k[:n], v[:n], g[:n], beta[:n], state, rows[:n], fresh[:n]
        )

    def run_prefill(n):
        lens = [min(2048, n - s) for s in range(0, n, 2048)][: slots_count - 1] + [1]
        cu = torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
        count = len(lens)
        gdn_delta_rule.chunk_gated_delta_rule(
            q, k, v, g, beta, state, cu, rows[:count], fresh[:count]
        )

    assert_one_variant(gdn_delta_rule, ["_gated_delta_rule_kernel"], run_decode)
    assert_one_variant(gdn_delta_rule, ["_gated_delta_rule_kernel"], run_prefill)

    def run_chunked(n):
        lens = [min(2048, n - s) for s in range(0, n, 2048)][: slots_count - 1] + [1]
        cu = torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
        count = len(lens)
        gdn_chunk.chunked_gated_delta_rule(q, k, v, g, beta, state, cu, rows[:count], fresh[:count])

    assert_one_variant(gdn_chunk, ["_chunk_inverse_kernel", "_chunk_state_kernel"], run_chunked)


@pytest.mark.gpu
def test_v4_window_write_and_decode_one_variant():
    """Rows (the grid) and entry counts (the top-k list length) swept."""
    heads, dim, window, slots = 64, 512, 128, 8
    ring = torch.randn(slots + 1, window, dim, device=DEVICE, dtype=BF16)
    pool = torch.randn(4097, 4, dim, device=DEVICE, dtype=BF16)
    q = torch.randn(max(SWEEP), heads, dim, device=DEVICE, dtype=BF16)
    kv = torch.randn(max(SWEEP), dim, device=DEVICE, dtype=BF16)
    sinks = torch.randn(heads, device=DEVICE)
    generator = _generator()

    def run(n):
        rows = min(n, 64)
        state = torch.randint(
            -1, slots, (n,), device=DEVICE, dtype=torch.int32, generator=generator
        )
        positions = torch.randint(0, 10**5, (n,), device=DEVICE, generator=generator)
        v4_attention.write_window(ring, kv[:n], state, positions)
        tables = _block_tables(rows, 1024, 4096)
        lens = torch.full((rows,), 1000, device=DEVICE, dtype=torch.int32)
        ids = torch.randint(-1, 250, (rows, n), device=DEVICE, generator=generator)
        v4_attention.v4_decode_attention(
            q[:rows], ring, state[:rows] % slots, lens.long() - 1, lens, pool, ids, tables,
            4, 16, sinks, dim**-0.5,
        )  # fmt: skip

    assert_one_variant(
        v4_attention, ["_write_window_kernel", "_v4_decode_kernel", "_v4_merge_kernel"], run
    )


@pytest.mark.gpu
def test_v4_mhc_one_variant():
    """Tokens (the grid) swept through hc_pre, hc_post and hc_head."""
    n, hidden = 4, 4096
    streams = torch.randn(max(SWEEP), n, hidden, device=DEVICE, dtype=BF16)
    fn = torch.randn((2 + n) * n, n * hidden, device=DEVICE) * 0.01
    head_fn = torch.randn(n, n * hidden, device=DEVICE) * 0.01
    base, scale = torch.randn((2 + n) * n, device=DEVICE), torch.ones(3, device=DEVICE)
    weight = torch.ones(hidden, device=DEVICE)

    def run(n_tokens):
        post, comb, x = v4_mhc.hc_pre(streams[:n_tokens], fn, base, scale, weight, 20,
                                      1e-6, 1e-6, 1e-6)  # fmt: skip
        v4_mhc.hc_post(x, streams[:n_tokens], post, comb)
        v4_mhc.hc_head(streams[:n_tokens], head_fn, base[:n], scale[:1], weight, 1e-6, 1e-6,
                       1e-6)  # fmt: skip

    names = ["_hc_mix_partial_kernel", "_hc_finish_kernel", "_hc_post_kernel"]
    history = variants_over_sweep(v4_mhc, names, run)
    # the block and the head are two geometries (M, HEAD) of the two pre kernels
    assert history["_hc_mix_partial_kernel"][-1] == 2, history
    assert history["_hc_finish_kernel"][-1] == 2, history
    assert history["_hc_post_kernel"][-1] == 1, history


@pytest.mark.gpu
def test_v41_mhc_one_variant():
    """Tokens (the grid) swept through DeepSeek-V4.1's variants: hc_pre_carried, hc_post
    rounded once and the final hc_collapse."""
    n, hidden = 4, 4096
    streams = torch.randn(max(SWEEP), n, hidden, device=DEVICE, dtype=BF16)
    carried = torch.rand(max(SWEEP), n, device=DEVICE)
    fn = torch.randn((2 + n) * n, n * hidden, device=DEVICE) * 0.01
    base, scale = torch.randn((2 + n) * n, device=DEVICE), torch.ones(3, device=DEVICE)
    weight = torch.ones(hidden, device=DEVICE, dtype=BF16)

    def run(n_tokens):
        pre, post, comb, x = v4_mhc.hc_pre_carried(
            streams[:n_tokens], carried[:n_tokens], fn, base, scale, weight, 20, 1e-6, 1e-6,
            1e-6,
        )  # fmt: skip
        v4_mhc.hc_post(x, streams[:n_tokens], post, comb, round_once=True)
        v4_mhc.hc_collapse(streams[:n_tokens], pre, weight, 1e-6)

    names = ["_hc_mix_partial_kernel", "_hc_finish_kernel", "_hc_post_kernel",
             "_hc_collapse_kernel"]  # fmt: skip
    assert_one_variant(v4_mhc, names, run)


@pytest.mark.gpu
def test_v41_norm_rope_round_normed_one_variant():
    dim, half = 512, 32
    x = torch.randn(max(SWEEP), 1, dim, device=DEVICE, dtype=BF16)
    weight = torch.rand(dim, device=DEVICE, dtype=BF16) + 0.5
    cos, sin = torch.randn(2, 70000, half, device=DEVICE).unbind(0)
    positions = torch.randint(0, 70000, (max(SWEEP),), device=DEVICE, generator=_generator())

    def run(n):
        v4_rope.norm_rope(x[:n], positions[:n], cos, sin, weight, 1e-6, round_normed=True)

    assert_one_variant(v4_rope, ["_norm_rope_kernel"], run)


@pytest.mark.gpu
def test_v41_route_with_temperature_one_variant():
    """DeepSeek-V4.1's routing: fp32 logits / gate_temp over the token sweep."""
    experts, top_k = 256, 8
    logits = torch.randn(max(SWEEP), experts, device=DEVICE)
    bias = torch.randn(experts, device=DEVICE) * 0.01

    def run(n):
        moe_routing.v4_route(logits[:n], top_k, 2.5, bias=bias, temperature=0.8)

    assert_one_variant(moe_routing, ["_route_kernel"], run)


@pytest.mark.gpu
def test_v4_norm_rope_one_variant():
    heads, dim, half = 64, 512, 32
    x = torch.randn(max(SWEEP), heads, dim, device=DEVICE, dtype=BF16)
    cos, sin = torch.randn(2, 70000, half, device=DEVICE).unbind(0)
    positions = torch.randint(0, 70000, (max(SWEEP),), device=DEVICE, generator=_generator())

    def run(n):
        v4_rope.norm_rope(x[:n], positions[:n], cos, sin, None, 1e-6)

    assert_one_variant(v4_rope, ["_norm_rope_kernel"], run)


@pytest.mark.gpu
def test_route_one_variant():
    """Tokens (the grid) swept through V4's score and hash routing and the softmax routing
    (three geometries)."""
    experts, top_k, vocab = 256, 8, 1000
    logits = torch.randn(max(SWEEP), experts, device=DEVICE, dtype=BF16)
    bias = torch.randn(experts, device=DEVICE) * 0.01
    input_ids = torch.randint(0, vocab, (max(SWEEP),), device=DEVICE, generator=_generator())
    tid2eid = torch.randint(0, experts, (vocab, top_k), device=DEVICE, generator=_generator())

    def run(n):
        moe_routing.v4_route(logits[:n], top_k, 2.5, bias=bias)
        moe_routing.v4_route(logits[:n], top_k, 2.5, input_ids=input_ids[:n], tid2eid=tid2eid)
        moe_routing.softmax_route(logits[:n], top_k, True)

    history = variants_over_sweep(moe_routing, ["_route_kernel"], run)
    assert history["_route_kernel"] == [3] * len(SWEEP), history


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8", "fp4", "fp4_e4m3"])
def test_v41_fake_quant_one_variant(mode):
    x = torch.randn(max(SWEEP), 32, device=DEVICE, dtype=BF16)

    def run(n):
        if mode == "fp8":
            v41_quant.fake_quant_fp8(x[:n], 32)
        else:
            v41_quant.fake_quant_fp4(
                x[:n, :16] if mode == "fp4_e4m3" else x[:n],
                16 if mode == "fp4_e4m3" else 32,
                mode == "fp4_e4m3",
            )

    assert_one_variant(v41_quant, ["_fake_quant_kernel"], run)


@pytest.mark.gpu
def test_v41_engram_hash_one_variant():
    tokens = torch.randint(0, 99092, (max(SWEEP), 4), device=DEVICE)
    multipliers = torch.randint(1, 2**40, (2, 4), device=DEVICE) * 2 + 1
    primes = torch.tensor([[[61, 67], [71, 73], [79, 83]]] * 2, device=DEVICE)
    offsets = torch.zeros(2, 6, dtype=torch.int64, device=DEVICE)

    def run(n):
        v41_engram.engram_hash(tokens[:n], multipliers, primes, offsets)

    assert_one_variant(v41_engram, ["_engram_hash_kernel"], run)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap,ratio", [(True, 4), (False, 128)])
def test_v4_compressor_decode_one_variant(overlap, ratio):
    dim, slots, block_size = 512, 8, 16
    width = 2 * dim if overlap else dim
    rows = 2 * ratio if overlap else ratio
    state_kv = torch.randn(slots + 1, rows, width, device=DEVICE, dtype=BF16)
    state_gate = torch.randn(slots + 1, rows, width, device=DEVICE, dtype=BF16)
    pool = torch.zeros(4097, *v4_compressor.pool_layout(block_size, ratio, dim), device=DEVICE,
                       dtype=BF16)  # fmt: skip
    kv = torch.randn(max(SWEEP), width, device=DEVICE, dtype=BF16)
    bias = torch.randn(ratio, width, device=DEVICE)
    weight = torch.ones(dim, device=DEVICE)
    cos, sin = torch.randn(2, 8192, 32, device=DEVICE)
    generator = _generator()

    def run(n):
        state = torch.randint(
            -1, slots, (n,), device=DEVICE, dtype=torch.int32, generator=generator
        )
        positions = torch.randint(0, 8000, (n,), device=DEVICE, generator=generator)
        tables = _block_tables(n, 8192, 4096)
        v4_compressor.compressor_decode(
            state_kv, state_gate, kv[:n], kv[:n], bias, weight, 1e-6, cos, sin, state,
            positions, tables, pool, ratio, overlap, block_size,
        )  # fmt: skip

    assert_one_variant(v4_compressor, ["_compressor_decode_kernel"], run)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 2])
def test_v41_compressor_latent_and_entry_store_one_variant(ratio):
    """DeepSeek-V4.1's decode emission: the compressor kernel's LATENT variant (ratio > 1)
    and the one-launch store of entries and keys, rows swept."""
    dim, key_dim, slots, block_size = 512, 128, 8, 16
    state_kv = torch.randn(slots + 1, max(ratio, 2), dim, device=DEVICE)
    state_gate = torch.randn(slots + 1, max(ratio, 2), dim, device=DEVICE)
    pool = torch.zeros(4097, *v4_compressor.pool_layout(block_size, ratio, dim), device=DEVICE,
                       dtype=BF16)  # fmt: skip
    index_pool = torch.zeros(4097, *v4_compressor.pool_layout(block_size, ratio, key_dim),
                             device=DEVICE, dtype=BF16)  # fmt: skip
    kv = torch.randn(max(SWEEP), dim, device=DEVICE)
    keys = torch.randn(max(SWEEP), key_dim, device=DEVICE, dtype=BF16)
    generator = _generator()

    def run(n):
        state = torch.randint(
            -1, slots, (n,), device=DEVICE, dtype=torch.int32, generator=generator
        )
        positions = torch.randint(0, 8000, (n,), device=DEVICE, generator=generator)
        latent = kv[:n].to(BF16)
        if ratio > 1:
            latent = v4_compressor.compressor_latent_decode(
                state_kv, state_gate, kv[:n], kv[:n], state, positions, BF16
            )
        tables = _block_tables(n, 8192, 4096)
        v4_compressor.store_entries_decode(
            pool, tables, state, positions, latent, ratio, block_size, index_pool, keys[:n]
        )

    names = ["_store_entries_decode_kernel"]
    names += ["_compressor_decode_kernel"] if ratio > 1 else []
    assert_one_variant(v4_compressor, names, run)


@pytest.mark.gpu
def test_v4_index_scores_one_variant():
    heads, dim = 64, 128
    pool = torch.randn(4097, 4, dim, device=DEVICE, dtype=BF16)
    q = torch.randn(64, heads, dim, device=DEVICE, dtype=BF16)
    weights = torch.randn(64, heads, device=DEVICE)
    generator = _generator()

    def run(n):
        rows = min(n, 64)
        tables = _block_tables(rows, 4 * n, 4096)
        positions = torch.randint(0, 4 * n, (rows,), device=DEVICE, generator=generator)
        lens = (positions + 1).int()
        v4_indexer.indexer_topk_decode(q[:rows], weights[:rows], pool, tables, positions, lens,
                                       4, 16, 512, n)  # fmt: skip

    assert_one_variant(v4_indexer, ["_index_scores_kernel"], run)
    assert_one_variant(v4_topk, ["_indexer_topk_kernel"], run)


@pytest.mark.gpu
def test_v4_topk_select_inside_allowed_entries_one_variant():
    """V4.1's second level (the select inside candidate blocks): widths, counts and k swept."""
    generator = _generator()

    def run(n):
        rows = min(n, 64)
        scores = torch.randn(rows, n, device=DEVICE, generator=generator)
        allowed = torch.rand(rows, n, device=DEVICE, generator=generator) < 0.5
        counts = torch.randint(0, n + 1, (rows,), device=DEVICE, generator=generator)
        v4_topk.indexer_topk_select(scores, counts, 1 + n % 600, allowed)

    assert_one_variant(v4_topk, ["_indexer_topk_kernel"], run)


SPLIT_TOPK_KERNELS = ["_topk_histogram_kernel", "_topk_count_kernel", "_topk_compact_kernel"]


@pytest.mark.gpu
@pytest.mark.parametrize("with_allowed", [False, True])
def test_v4_topk_split_select_one_variant(with_allowed):
    """The split select: widths, counts, k and the split count swept (1 .. 128 programs a
    row), one compiled variant of each kernel (the 4 rounds included)."""
    generator = _generator()

    def run(n):
        rows = 1 + n % 3
        scores = torch.randn(rows, n, device=DEVICE, generator=generator)
        allowed = None
        if with_allowed:
            allowed = torch.rand(rows, n, device=DEVICE, generator=generator) < 0.5
        counts = torch.randint(0, n + 1, (rows,), device=DEVICE, generator=generator)
        splits = 1 + n % v4_topk.MAX_SPLITS
        v4_topk.indexer_topk_select_split(scores, counts, 1 + n % 600, allowed, splits)

    assert_one_variant(v4_topk, SPLIT_TOPK_KERNELS, run)


@pytest.mark.gpu
def test_v4_decode_every_visible_entry_one_variant():
    """HCA (every visible entry, no id list): positions (the loop bound) and rows swept."""
    heads, dim, window, slots = 64, 512, 128, 8
    ring = torch.randn(slots + 1, window, dim, device=DEVICE, dtype=BF16)
    pool = torch.randn(4097, 1, dim // 8, device=DEVICE, dtype=BF16)  # HCA: 128 / 16 parts
    q = torch.randn(64, heads, dim, device=DEVICE, dtype=BF16)
    sinks = torch.randn(heads, device=DEVICE)
    generator = _generator()

    def run(n):
        rows = min(n, 64)
        tables = _block_tables(rows, 16 * n, 4096)
        state = torch.randint(0, slots, (rows,), device=DEVICE, dtype=torch.int32)
        positions = torch.randint(0, 16 * n, (rows,), device=DEVICE, generator=generator)
        v4_attention.v4_decode_attention(
            q[:rows], ring, state, positions, (positions + 1).int(), pool, None, tables,
            128, 16, sinks, dim**-0.5,
        )  # fmt: skip

    assert_one_variant(v4_attention, ["_v4_decode_kernel"], run)


@pytest.mark.gpu
@pytest.mark.parametrize("entries", ["none", "every_visible", "chosen"])
def test_v4_prefill_attention_one_variant(entries):
    """Queries (the grid), the first query's position, the window keys' first position,
    the entry count and the id list's width swept: one variant per geometry."""
    heads, dim, window = 64, 512, 128
    ratio = 128 if entries == "every_visible" else 4
    q = torch.randn(64, heads, dim, device=DEVICE, dtype=BF16)
    keys = torch.randn(64 + window, dim, device=DEVICE, dtype=BF16)
    pooled = torch.randn((max(SWEEP) + 64) // ratio, dim, device=DEVICE, dtype=BF16)
    sinks = torch.randn(heads, device=DEVICE)
    generator = _generator()

    def run(n):
        rows, start = min(n, 64), n - 1
        key_first = max(0, start - window + 1)
        num_entries = (start + rows) // ratio
        ids = None
        if entries == "chosen":
            width = max(1, min(512, num_entries))
            ids = torch.randint(-1, max(1, num_entries), (rows, width), device=DEVICE,
                                generator=generator)  # fmt: skip
        v4_prefill_attention.v4_prefill_attention(
            q[:rows], keys[: start + rows - key_first], key_first, start,
            None if entries == "none" else pooled[:num_entries], ids, ratio, window, sinks,
            dim**-0.5,
        )  # fmt: skip

    assert_one_variant(v4_prefill_attention, ["_v4_prefill_kernel"], run)


@pytest.mark.gpu
def test_v4_indexer_topk_prefill_one_variant():
    """The scorer and select with the query tokens as rows (a zero table-row stride), the
    first query's position swept."""
    heads, dim = 64, 128
    pool = torch.randn(4097, 4, dim, device=DEVICE, dtype=BF16)
    q = torch.randn(64, heads, dim, device=DEVICE, dtype=BF16)
    weights = torch.randn(64, heads, device=DEVICE)

    def run(n):
        rows = min(n, 64)
        table = _block_tables(1, n + rows, 4096)
        v4_indexer.indexer_topk_prefill(q[:rows], weights[:rows], pool, table, n - 1, 4, 16, 512)

    assert_one_variant(v4_indexer, ["_index_scores_kernel"], run)
    assert_one_variant(v4_topk, ["_indexer_topk_kernel"], run)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["write", "greedy", "greedy_stats", "stats"])
def test_sampling_kernels_one_variant(mode):
    """Batch, vocabulary, bias / stop table widths and k all swept through the sampling pass
    (one mode per sweep: its switches are constexprs, one variant per mode: the options
    written, their argmax, their argmax with the raw statistics, the statistics alone), the
    top-k selection, the rank count and the state update."""
    from atom.model_engine.sampling.state import SamplingState

    generator = _generator()
    options = sampling.apply_sampling_options if mode == "write" else sampling.greedy_with_sampling_options  # fmt: skip
    extra = {"stats": True} if mode == "greedy_stats" else {}

    def run(n):
        rows, vocab, k = 1 + n % 64, 1000 + n % 7000, 1 + n % 20
        logits = torch.randn(rows, vocab, device=DEVICE, dtype=BF16, generator=generator)
        state_rows = torch.randint(0, 8, (rows,), device=DEVICE, dtype=torch.int32)
        counts = torch.randint(0, 3, (8, vocab), device=DEVICE, dtype=torch.int32)
        floats = torch.rand(8, 3, device=DEVICE)
        ints = torch.randint(0, 4, (8, 4), device=DEVICE, dtype=torch.int32)
        width = min(n, 4096)
        ints[:, 2:].clamp_(max=width)  # entries within the tables' width
        tokens = torch.randint(0, vocab, (8, width), device=DEVICE, dtype=torch.int32)
        tokens = tokens.sort(dim=1).values
        values = torch.rand(8, width, device=DEVICE)
        edges = torch.arange(0, vocab + sampling.BLOCK, sampling.BLOCK, device=DEVICE)
        start = torch.searchsorted(tokens, edges.int().expand(8, -1).contiguous()).int()
        ids = torch.arange(rows, device=DEVICE)
        if mode == "stats":
            sampling.logprob_candidates(logits, ids, k)
        else:
            got = options(logits, state_rows, counts, floats, ints, start, tokens, values, tokens, **extra)  # fmt: skip
        if mode == "greedy_stats":
            sampling.logprob_candidates(logits, ids, k, stats=got[1])
        sampling.count_greater(logits, ids, torch.zeros(rows, device=DEVICE))
        state = SamplingState(8, vocab, torch.device(DEVICE))
        state._allocate()
        state.count_sampled(state_rows, torch.randint(0, vocab, (rows,), device=DEVICE))

    assert_one_variant(
        sampling,
        ["_sampling_pass_kernel", "_count_greater_kernel", "_count_sampled_kernel"],
        run,
    )
    if mode in ("stats", "greedy_stats"):
        assert_one_variant(logprob_topk, ["_select_topk_kernel"], run)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(1, 4096), (128, 128), (1, 128)])
def test_fp8_linear_one_variant_per_geometry(block):
    """Batch rows never add variants: rows 2..16 share the dot kernel's 16-row tiles, more
    rows its 64-row tiles (block scales; per-row scales take torch._scaled_mm), one row the
    GEMV; layer shapes (multiples of 16) share the GEMV's variant."""
    generator = torch.Generator(DEVICE).manual_seed(0)
    weight = torch.randn(4096, 4096, device=DEVICE, generator=generator).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-4096 // block[0]), -(-4096 // block[1]), device=DEVICE) + 0.5
    x = torch.randn(4097, 4096, device=DEVICE, dtype=BF16)

    def run(n):
        fp8_linear.fp8_linear(x[:n], weight, scale, block)

    assert_one_variant(fp8_linear, ["_fp8_dot_kernel"], run, [2, 3, 7, 16])
    if block[0] > 1 or block[1] < 4096:
        assert_one_variant(fp8_linear, ["_fp8_dot_kernel"], run, [17, 64, 257, 4097])
    shapes = [(4096, 6144), (4096, 4096), (14336, 4096)]
    config = gemv.GemvConfig(4, 512, 4, 3)

    def gemv_over_shapes(i):  # one tile: the layer shapes (multiples of 16) share it
        cols, rows = shapes[i]
        w = torch.randn(rows, cols, device=DEVICE).to(torch.float8_e4m3fn)
        blocks = (block[0], cols if block[1] == 4096 else block[1])
        s = torch.rand(-(-rows // blocks[0]), -(-cols // blocks[1]), device=DEVICE)
        x1 = torch.randn(1, cols, device=DEVICE, dtype=BF16)
        fp8_linear.fp8_gemv(x1, w, s, blocks, config=config)

    assert_one_variant(fp8_linear, ["_fp8_gemv_kernel"], gemv_over_shapes, range(3))


@pytest.mark.gpu
@pytest.mark.parametrize("group", [128, 4096])
def test_int4_linear_one_variant_per_geometry(group, monkeypatch):
    """Rows 2..16 share the dot kernel's 16-row tiles, more rows its 64-row tiles, one row
    the GEMV (with the heuristic's tile: the tuner, which compiles each candidate once, off)."""
    from atom.fusions import Fusions
    from atom.kernels import gemv_tiles

    # Fusions.quant_gemv_tune off (ATOM_QUANT_GEMV_TUNE=0 in an engine's Config)
    monkeypatch.setattr(gemv_tiles, "current_fusions", lambda: Fusions(quant_gemv_tune=False))
    generator = torch.Generator(DEVICE).manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (512, 4096), device=DEVICE, dtype=torch.int32,
                          generator=generator)  # fmt: skip
    scale = torch.rand(-(-4096 // group), 4096, device=DEVICE) + 0.5
    zero = torch.full_like(scale, 8, dtype=torch.uint8)
    x = torch.randn(4097, 4096, device=DEVICE, dtype=BF16)

    def run(n):
        int4_linear.int4_linear(x[:n], words, scale, zero, group)

    assert_one_variant(int4_linear, ["_int4_dot_kernel"], run, [2, 3, 7, 16])
    assert_one_variant(int4_linear, ["_int4_dot_kernel"], run, [17, 64, 257, 4097])
    assert_one_variant(int4_linear, ["_int4_gemv_kernel"], run, [1, 1])

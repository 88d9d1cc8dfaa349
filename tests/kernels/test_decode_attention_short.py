"""paged_decode_attention_short (Fusions.decode_short) against the decode reference.

On CPU the kernel runs under TRITON_INTERPRET=1 (conftest) in fp32 and bf16, with tiny
shapes and tiles small enough that contexts cross block, tile, split and merge-chunk
boundaries; on CUDA also at the benchmark's head geometries with each sweep candidate.
"""

import pytest
import torch

from atom.kernels import decode_attention_short, paged_decode_attention_reference
from atom.kernels.decode_attention import split_counters
from atom.kernels.decode_attention_short import (
    ShortDecodeConfig,
    grid_splits,
    merge_chunk,
    paged_decode_attention_short,
)
from tests.kernels.paged_kv import make_paged_kv, quantize_paged_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5 if DEVICE == "cpu" else 5e-3, torch.bfloat16: 3e-2}
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 32, 8  # GQA group 3 (padded to 4)
# 0: a padding row; 1; 7/8/9: a block boundary; 16/17: a 16-token tile or split boundary;
# 300: more than merge_chunk(3, 32) = 16 splits of 16 tokens (two merge trips)
CONTEXTS = [0, 1, 9, 16, 17, 300, 8, 7]


def _case(context_lens, dtype, kv_cache_dtype, seed=0):
    batch = len(context_lens)
    k_cache, v_cache, block_tables, _, _ = make_paged_kv(
        context_lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype, DEVICE, capacity=batch + 1,
        seed=seed,
    )  # fmt: skip
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed))
    q = q.to(DEVICE, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    kv_scales = {}
    if kv_cache_dtype == "fp8":
        k_cache, v_cache, k_scale, v_scale = quantize_paged_kv(k_cache, v_cache)
        kv_scales = dict(k_scale=k_scale, v_scale=v_scale)
    return (q, k_cache, v_cache, block_tables, lens, HEAD_DIM**-0.5), kv_scales


def _check(args, kv_scales, config, dtype):
    expected = paged_decode_attention_reference(*args, **kv_scales)
    out = torch.full_like(args[0], float("nan"))  # every element must be written
    result = paged_decode_attention_short(*args, out=out, config=config, **kv_scales)
    assert result is out
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    padding = args[4] == 0
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))
    # the merging programs left their counters at zero for the next launch
    assert not split_counters(out.device, len(args[4]) * NUM_KV_HEADS).any()


@pytest.mark.parametrize(
    "config, kv_cache_dtype",
    [
        (ShortDecodeConfig(block_n=16, split_tokens=16), "auto"),  # 19 splits: 2 merge trips
        (ShortDecodeConfig(block_n=16, split_tokens=48), "fp8"),  # 3 tiles a split
        (ShortDecodeConfig(block_n=32, split_tokens=512), "auto"),  # one split, 10 tiles
    ],
    ids=["tiles16-split16", "tiles16-split48-fp8", "tiles32-one-split"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_decode_matches_reference(config, kv_cache_dtype, dtype):
    args, kv_scales = _case(CONTEXTS, dtype, kv_cache_dtype)
    _check(args, kv_scales, config, dtype)


def test_short_decode_default_config_and_second_launch():
    """The geometry's default config (one split up to its split size, here 300 tokens take
    two), launched twice: the second launch finds the counters reset."""
    args, kv_scales = _case([300, 0, 40], torch.float32, "auto", seed=1)
    for _ in range(2):
        _check(args, kv_scales, None, torch.float32)


def test_wide_tables_get_longer_splits_not_more(monkeypatch):
    """Past MAX_SPLITS the split size grows (in whole tiles): the grid stays bounded."""
    config = ShortDecodeConfig(block_n=16, split_tokens=16)
    assert grid_splits(312, config) == (16, 20)
    assert grid_splits(1, config) == (16, 1)
    # 132 SMs, 4 programs each, batch 4 x 8 kv heads: at most 16 splits
    assert grid_splits(8192, ShortDecodeConfig(64, 64), 32, 132) == (512, 16)
    assert grid_splits(8192, ShortDecodeConfig(64, 64, programs_per_sm=16), 32, 132) == (128, 64)
    monkeypatch.setattr(decode_attention_short, "MAX_SPLITS", 4)
    assert grid_splits(312, config) == (80, 4)  # cdiv(312, 4 * 16) tiles of 16 a split
    args, kv_scales = _case([300, 5], torch.float32, "auto", seed=2)
    _check(args, kv_scales, config, torch.float32)


def test_config_rejects_split_sizes_that_are_not_whole_tiles():
    with pytest.raises(ValueError, match="multiple of block_n"):
        ShortDecodeConfig(block_n=32, split_tokens=48)
    with pytest.raises(ValueError, match="power of two"):
        ShortDecodeConfig(block_n=24, split_tokens=48)
    assert merge_chunk(3, 32) == 16 and merge_chunk(4, 64) == 16 and merge_chunk(8, 256) == 2


# -- on the GPU: the benchmark's geometries and candidates, CUDA-graph replays ---------------

GEOMETRIES = [(32, 8, 64), (9, 3, 64)]  # Llama-3.2-1B, SmolLM2-135M


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", GEOMETRIES)
def test_short_decode_sweep_candidates_match_reference(
    num_q_heads, num_kv_heads, head_dim, kv_cache_dtype
):
    """bf16: the default and the quick sweep's candidates (the full sweep checks its own
    outputs, max_err); fp8: the default."""
    from benchmarks.decode_attention_sweep import candidates

    context_lens = [4096, 1, 0, 257, 255, 256, 1000, 64]
    k_cache, v_cache, block_tables, _, _ = make_paged_kv(
        context_lens, num_kv_heads, head_dim, 16, torch.bfloat16, "cuda", capacity=8
    )
    kv_scales = {}
    if kv_cache_dtype == "fp8":
        k_cache, v_cache, k_scale, v_scale = quantize_paged_kv(k_cache, v_cache)
        kv_scales = dict(k_scale=k_scale, v_scale=v_scale)
    q = torch.randn(4, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    for rows in (slice(0, 4), slice(4, 8)):  # two batches of 4 (the kernel's largest)
        lens = torch.tensor(context_lens[rows], dtype=torch.int32, device="cuda")
        args = (q, k_cache, v_cache, block_tables[rows], lens, head_dim**-0.5)
        expected = paged_decode_attention_reference(*args, **kv_scales)
        configs = [None, *candidates(quick=True)] if kv_cache_dtype == "auto" else [None]
        for config in configs:
            out = torch.full_like(q, float("nan"))
            paged_decode_attention_short(*args, out=out, config=config, **kv_scales)
            torch.testing.assert_close(
                out.float(),
                expected.float(),
                atol=3e-2,
                rtol=3e-2,
                msg=lambda m, c=config: f"{c}: {m}",
            )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(8, 2, 128), (16, 2, 256)])
def test_short_decode_default_config_other_geometries(num_q_heads, num_kv_heads, head_dim, dtype):
    context_lens = [1000, 0, 300, 17]
    k_cache, v_cache, block_tables, _, _ = make_paged_kv(
        context_lens, num_kv_heads, head_dim, 16, dtype, "cuda", capacity=4
    )
    q = torch.randn(4, num_q_heads, head_dim, device="cuda", dtype=dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
    args = (q, k_cache, v_cache, block_tables, lens, head_dim**-0.5)
    out = paged_decode_attention_short(*args)
    expected = paged_decode_attention_reference(*args)
    tol = 5e-3 if dtype != torch.bfloat16 else 3e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
def test_short_decode_replays_in_cuda_graph_with_new_lengths():
    """One graph captured at a 4096-token table serves short and long rows, padding too."""
    num_q_heads, num_kv_heads, head_dim = 32, 8, 64
    context_lens = [4096, 700, 1, 40]
    k_cache, v_cache, block_tables, _, _ = make_paged_kv(
        context_lens, num_kv_heads, head_dim, 16, torch.bfloat16, "cuda", capacity=4
    )
    q = torch.randn(4, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    args = (q, k_cache, v_cache, block_tables, lens, head_dim**-0.5)
    paged_decode_attention_short(*args, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention_short(*args, out=out)
    for new_lens in ([4096, 700, 1, 40], [5, 0, 1, 33], [4000, 1, 0, 0], [256, 257, 512, 0]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.normal_()
        graph.replay()
        expected = paged_decode_attention_reference(*args)
        torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)
    assert not split_counters(q.device, 4 * num_kv_heads).any()


def test_sweep_chooses_the_smallest_worst_slowdown_and_prints_a_pasteable_table():
    from benchmarks.decode_attention_sweep import candidates, choose, config_table, label

    times = {  # case -> path -> us
        (1, 512, 64): {"a": 1.0, "b": 1.1, "c": 3.0},
        (1, 512, 384): {"a": 2.0, "b": 1.2, "c": 1.0},
    }
    assert choose(times, ["a", "b", "c"]) == "b"  # worst 1.2x; a is 2x off, c 3x
    configs = candidates()
    assert len({label(c) for c in configs}) == len(configs)
    assert candidates(quick=True) and set(candidates(quick=True)) <= set(configs)
    chosen = {(32, 8, 64): configs[0], (9, 3, 64): configs[-1]}
    namespace = {"ShortDecodeConfig": ShortDecodeConfig}
    exec(config_table(chosen), namespace)  # what the lead pastes into CONFIGS
    assert namespace["CONFIGS"] == chosen

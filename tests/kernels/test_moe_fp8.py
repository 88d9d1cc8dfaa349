"""fused_moe with FP8 e4m3 experts and float32 block scales (DeepSeek-V2/V3's block FP8)
against the torch reference on the dequantized weights.

The kernels dequantize each weight tile to x's dtype as they read it, element for element
what ``dequantize_fp8_reference(...).to(x.dtype)`` gives, then run the GEMMs of the bf16
path: in fp32 the results equal the reference's within fp32 rounding, in fp16/bf16 within
the bf16 MoE tests' tolerances. On CPU the kernels run under TRITON_INTERPRET=1 (conftest)
on tiny shapes with small blocks; on CUDA bf16 at a DeepSeek-V3-like expert shape with
128 x 128 blocks.
"""

import pytest
import torch

from atom.kernels import moe
from atom.kernels.fp8_linear import dequantize_fp8_reference
from atom.models.moe import routed_experts
from tests.kernels.test_moe import _ids

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def _quantize(weight: torch.Tensor, block: tuple[int, int]):
    """(fp8 [E, N, K], float32 scales [E, ceil(N/rows), ceil(K/cols)]): each block's amax
    maps to e4m3's 448, ragged blocks at the edges."""
    experts, rows, cols = weight.shape
    block_rows, block_cols = block
    scale = torch.empty(experts, -(-rows // block_rows), -(-cols // block_cols))
    for i in range(scale.shape[1]):
        for j in range(scale.shape[2]):
            tile = weight[
                :, i * block_rows : (i + 1) * block_rows, j * block_cols : (j + 1) * block_cols
            ]
            scale[:, i, j] = tile.abs().amax(dim=(1, 2)).clamp_min(1e-12) / 448
    full = dequantize_fp8_reference(torch.ones_like(weight), scale, block)
    return (weight / full).to(FP8), scale


def _fp8_inputs(num_tokens, num_experts, top_k, hidden, intermediate, blocks, dtype, seed):
    """(x, weights, ids, gate_up fp8, down fp8), Fp8Scales, and the dequantized weights in
    x's dtype (what the reference runs)."""
    gate_up_block, down_block = blocks
    generator = torch.Generator().manual_seed(seed)
    ids = _ids(num_tokens, num_experts, top_k, generator, skew=True)
    weights = torch.rand(num_tokens, top_k, generator=generator)
    x = torch.randn(num_tokens, hidden, generator=generator)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator)
    down = torch.randn(num_experts, hidden, intermediate, generator=generator)
    gate_up, gate_up_scale = _quantize(gate_up * hidden**-0.5, gate_up_block)
    down, down_scale = _quantize(down * intermediate**-0.5, down_block)
    scales = moe.Fp8Scales(
        gate_up_scale.to(DEVICE), down_scale.to(DEVICE), gate_up_block, down_block
    )
    args = (x.to(DEVICE, dtype), weights.to(DEVICE), ids.to(DEVICE))
    weights_fp8 = (gate_up.to(DEVICE), down.to(DEVICE))
    return args, weights_fp8, scales, scales.dequantize(*weights_fp8, dtype)


# (gate_up block, down block) for hidden 48, intermediate 32
BLOCKS = {
    # 16 x 16: the gate/up boundary (row 32) on a block edge; 48 rows of down in 3 blocks
    "16x16": ((16, 16), (16, 16)),
    # Fp8Experts' blocks where the up rows start inside a checkpoint block (24 x 32 on
    # intermediate 32): one row high for gate_up; down keeps 24 x 32 (ragged: 48 = 2 x 24
    # rows, 32 columns in one block); gate_up's 48 columns span a block and a half
    "straddle_24x32": ((1, 32), (24, 32)),
    # a gate_up block spanning the last gate and the first up rows (rows 24..47 across 32),
    # which the kernels index as any other (Fp8Experts never builds one: see above)
    "across_gate_up_24x16": ((24, 16), (24, 16)),
    # one scale per row over all columns (per-channel FP8)
    "per_row": ((1, 48), (1, 32)),
    # 24 columns a scale: no power-of-2 chunk of 16 or more stays in one scale column, so
    # fused_moe dequantizes the experts and runs the bf16 kernels
    "dequantized_24": ((16, 24), (16, 24)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("blocks", list(BLOCKS))
@pytest.mark.parametrize(
    "swiglu_limit, weight_before_down", [(None, False), (0.5, False), (None, True)]
)
def test_fused_moe_fp8_matches_reference_on_dequantized_weights(
    blocks, swiglu_limit, weight_before_down, dtype, monkeypatch
):
    args, weights_fp8, scales, dequantized = _fp8_inputs(
        19, 6, 3, 48, 32, BLOCKS[blocks], dtype, seed=7
    )
    x_before = args[0].clone()
    dequantizations = []
    real_dequantize = moe.Fp8Scales.dequantize

    def dequantize(self, *weights):
        dequantizations.append(self)
        return real_dequantize(self, *weights)

    monkeypatch.setattr(moe.Fp8Scales, "dequantize", dequantize)
    out = moe.fused_moe(
        *args, *weights_fp8, swiglu_limit, weight_before_down=weight_before_down, fp8_scales=scales
    )
    # the kernels read the FP8 weights unless no chunk fits in a scale column
    assert len(dequantizations) == (blocks == "dequantized_24")
    expected = moe.routed_experts_reference(
        *args, *dequantized, swiglu_limit, weight_before_down=weight_before_down
    )
    assert out.shape == args[0].shape and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(args[0], x_before, rtol=0, atol=0)


def test_fp8_kernels_run_where_a_chunk_stays_in_one_scale_column():
    """Which scale blocks the kernels read as FP8 (else: dequantized first)."""
    assert moe.fp8_block_k(128, 128, 7168) == 128  # DeepSeek-V3
    assert moe.fp8_block_k(128, 32, 48) == 32
    assert moe.fp8_block_k(64, 48, 48) == 64  # one scale column: any chunk
    assert moe.fp8_block_k(128, 96, 256) == 32
    assert moe.fp8_block_k(128, 24, 48) is None


def test_fused_moe_fp8_tiles_and_no_tokens():
    args, weights_fp8, scales, dequantized = _fp8_inputs(
        9, 8, 2, 48, 32, BLOCKS["16x16"], torch.float32, seed=3
    )
    expected = moe.routed_experts_reference(*args, *dequantized)
    for tiles in (moe.MoeTiles(16, 16, 16), moe.MoeTiles(32, 32, 64)):
        out = moe.fused_moe(*args, *weights_fp8, tiles=tiles, fp8_scales=scales)
        torch.testing.assert_close(out, expected)
    empty = [a[:0] for a in args]
    assert moe.fused_moe(*empty, *weights_fp8, fp8_scales=scales).shape == (0, 48)


def test_fused_moe_fp8_takes_the_grouped_gemms_at_any_pair_count(monkeypatch):
    """The per-pair decode GEMV reads weights in x's dtype only: FP8 experts keep the
    grouped GEMMs even where the GEMV would run (forced here at every pair count)."""
    from atom.kernels import moe_gemv

    monkeypatch.setattr(moe, "DECODE_GEMV_OVERRIDE", True)
    monkeypatch.setattr(moe_gemv, "routed_pairs", None)  # must not be called
    args, weights_fp8, scales, dequantized = _fp8_inputs(
        1, 8, 2, 48, 32, BLOCKS["16x16"], torch.float32, seed=6
    )
    out = moe.fused_moe(*args, *weights_fp8, fp8_scales=scales)
    torch.testing.assert_close(out, moe.routed_experts_reference(*args, *dequantized))


def test_routed_experts_reference_path_dequantizes_first(monkeypatch):
    """atom/models/moe.py off the CUDA path: the reference on the dequantized experts, bit
    for bit."""
    monkeypatch.setenv("ATOM_INTERPRET_CUDA_PATH", "0")
    args, weights_fp8, scales, dequantized = _fp8_inputs(
        7, 6, 2, 48, 32, BLOCKS["straddle_24x32"], torch.float32, seed=4
    )
    out = routed_experts(*args, *weights_fp8, fp8_scales=scales)
    expected = moe.routed_experts_reference(*args, *dequantized)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# -- on the GPU ----------------------------------------------------------------------------------

# DeepSeek-V3's expert shape (hidden 7168, moe_intermediate 2048, 256 experts, 8 per token)
# with fewer experts, to keep the fp32 reference's weights small
V3 = dict(num_experts=32, top_k=8, hidden=7168, intermediate=2048)
V3_BLOCKS = ((128, 128), (128, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
@pytest.mark.parametrize("swiglu_limit, weight_before_down", [(None, False), (10.0, True)])
def test_fused_moe_fp8_bf16_cuda(num_tokens, swiglu_limit, weight_before_down):
    args, weights_fp8, scales, dequantized = _fp8_inputs(
        num_tokens, **V3, blocks=V3_BLOCKS, dtype=torch.bfloat16, seed=8
    )
    out = moe.fused_moe(
        *args, *weights_fp8, swiglu_limit, weight_before_down=weight_before_down, fp8_scales=scales
    )
    expected = moe.routed_experts_reference(
        *args, *dequantized, swiglu_limit, weight_before_down=weight_before_down
    )
    # as the bf16 test: the kernel sums the k contributions in fp32 (HF: in bf16)
    scale = expected.abs().max()
    assert (out.float() - expected.float()).abs().max() <= 2e-2 * scale


@pytest.mark.gpu
def test_fused_moe_fp8_is_graph_capturable_without_host_sync():
    args, weights_fp8, scales, _ = _fp8_inputs(
        16, **V3, blocks=V3_BLOCKS, dtype=torch.bfloat16, seed=9
    )
    x, weights, ids = args

    def call():
        return moe.fused_moe(x, weights, ids, *weights_fp8, fp8_scales=scales)

    call()  # compile outside capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    generator = torch.Generator().manual_seed(10)
    ids.copy_(_ids(16, V3["num_experts"], V3["top_k"], generator, skew=True))
    x.copy_(torch.randn(x.shape, generator=generator))
    graph.replay()
    torch.testing.assert_close(out, call())

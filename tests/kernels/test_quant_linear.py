"""The quantized linear kernels (atom/kernels/fp8_linear.py, int4_linear.py) against a torch
reference: the checkpoint's weight dequantized by the test's own packer
(tests/models/test_quantized_checkpoints.py), then a float32 matmul.

Each weight goes the way a checkpoint's does: checkpoint tensors in the format's layout, read
by the quantization package (read_fp8_weight / read_int4_weight) and loaded into a layer by
its linear method; the kernels then run on the layer's tensors. On CPU the kernels run
under TRITON_INTERPRET=1 on small shapes (every scale layout; one row, dot-kernel row
counts and a GEMM row count); the `gpu` tests run the Llama-3.1-8B layer shapes, the
layers' `apply` on CUDA, a CUDA-graph replay, and say which path served more than 16 rows.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from atom.kernels import fp8_linear as fp8_kernels
from atom.kernels import int4_linear as int4_kernels
from atom.kernels.fp8_linear import fp8_linear, quantize_rows_fp8
from atom.kernels.gemv_tiles import GemvConfig, quant_gemv_candidates, quant_gemv_config
from atom.kernels.int4_linear import int4_linear
from atom.models.quantization import Fp8LinearMethod, Int4LinearMethod, read_quantization_scheme
from atom.models.quantization.fp8 import read_fp8_weight
from atom.models.quantization.int4 import read_int4_weight
from tests.models.test_quantized_checkpoints import CONFIGS, quantize_linear

pytest.importorskip("triton")

FP8_FORMATS = ["ct_fp8:tensor", "ct_fp8:channel", "ct_fp8:block", "deepseek_fp8:128x128"]
INT4_FORMATS = [
    "ct_int4:sym_group",
    "ct_int4:asym_group",
    "ct_int4:sym_channel",
    "gptq:group",
    "gptq:channel",
    "awq:group",
]


def scheme_of(fmt):
    kind, _, option = fmt.partition(":")
    return read_quantization_scheme(SimpleNamespace(quantization_config=CONFIGS[kind](option)))


def quantized_layer(fmt, parts, device="cpu"):
    """A layer holding the fused `parts` ({name: float32 [rows, K]}, stacked as q | k | v
    or gate | up are) loaded from their checkpoint tensors in `fmt`, and the dequantized
    float32 weight [sum rows, K] the test's packer computed."""
    scheme = scheme_of(fmt)
    method = Fp8LinearMethod(scheme) if scheme.kind == "fp8" else Int4LinearMethod(scheme)
    read = read_fp8_weight if scheme.kind == "fp8" else read_int4_weight
    layer = nn.Module()
    sizes = [w.shape[0] for w in parts.values()]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    cols = next(iter(parts.values())).shape[1]
    method.create_weights(layer, sum(sizes), cols, starts, 0)
    dequantized = []
    for (name, w), start in zip(parts.items(), starts, strict=True):
        tensors, deq = quantize_linear(name, w, fmt)
        pieces = {key.rpartition(".")[2]: value for key, value in tensors.items()}
        method.load(layer, read(name, pieces, scheme), start, 0, w.shape[0], 0)
        dequantized.append(deq)
    layer.to(device)
    return layer, method, torch.cat(dequantized).to(device)


def random_parts(sizes, cols, seed, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(rows, cols, generator=generator) * 0.05 for i, rows in
            enumerate(sizes)}  # fmt: skip


def run_kernel(layer, method, x, bias=None):
    if isinstance(method, Fp8LinearMethod):
        assert fp8_kernels.fits_fp8_kernels(x, layer.weight, layer.weight_scale, layer.weight_block)
        return fp8_linear(x, layer.weight, layer.weight_scale, layer.weight_block, bias)
    assert int4_kernels.fits_int4_kernels(
        x, layer.weight, layer.weight_scale, layer.weight_zero_point, layer.weight_group
    )
    return int4_linear(
        x, layer.weight, layer.weight_scale, layer.weight_zero_point, layer.weight_group, bias
    )


def check(out, x, dequantized, bias=None, tolerance=None):
    """out against the float32 product with the dequantized weight: within a bound set by
    the rounding of x's dtype (the weight rounded to it, the output rounded to it)."""
    reference = F.linear(x.float(), dequantized.float(), None if bias is None else bias.float())
    assert out.dtype == x.dtype and out.shape == reference.shape
    if tolerance is None:
        tolerance = 1e-5 if x.dtype == torch.float32 else 2e-2
    scale = reference.abs().max().item() + 1e-6
    error = (out.float() - reference).abs().max().item()
    assert error <= tolerance * scale, f"max error {error:.3g} vs max |ref| {scale:.3g}"


# -- CPU, Triton's interpreter: small shapes, every layout ----------------------------------
SIZES = [96, 64]  # two fused parts: the second starts inside a 128-row block (blocks of one row)
COLS = 384


# Rows: 1 takes the GEMV, 2..16 the dot kernel's one 16-row tile (num_rows is a runtime
# length: one compiled variant; 2, a part-masked 13 and a full 16 stand for it), 40 the
# 64-row GEMM tile.
ROW_COUNTS = [1, 2, 13, 16, 40]


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_fp8_kernels_match_the_dequantized_reference(fmt, rows):
    layer, method, dequantized = quantized_layer(fmt, random_parts(SIZES, COLS, seed=rows))
    x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(rows)).bfloat16()
    check(run_kernel(layer, method, x), x, dequantized)


@pytest.mark.parametrize("fmt", ["ct_fp8:channel", "deepseek_fp8:128x128"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_fp8_kernels_fp32_with_bias_and_whole_blocks(fmt, rows):
    """fp32 activations are exact to rounding; a bias; a single part (128-row blocks)."""
    layer, method, dequantized = quantized_layer(fmt, random_parts([256], COLS, seed=7))
    assert layer.weight_block[0] == (128 if fmt.startswith("deepseek") else 1)
    x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(256)
    check(run_kernel(layer, method, x, bias), x, dequantized, bias)


def test_fp8_block_of_a_fused_part_is_one_row_high():
    layer, _, _ = quantized_layer("deepseek_fp8:128x128", random_parts(SIZES, COLS, seed=3))
    assert layer.weight_block == (1, 128)


@pytest.mark.parametrize("fmt", INT4_FORMATS)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_int4_kernels_match_the_dequantized_reference(fmt, rows):
    layer, method, dequantized = quantized_layer(fmt, random_parts(SIZES, COLS * 2, seed=rows))
    x = torch.randn(rows, COLS * 2, generator=torch.Generator().manual_seed(rows)).bfloat16()
    check(run_kernel(layer, method, x), x, dequantized)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
def test_int4_group_128_row_counts(rows):
    layer, method, dequantized = quantized_layer("gptq:group", random_parts([160], 512, seed=2))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    check(run_kernel(layer, method, x), x, dequantized)


@pytest.mark.parametrize("fmt", ["ct_int4:asym_group", "awq:group"])
@pytest.mark.parametrize("rows", [1, 6, 33])
def test_int4_kernels_fp32_with_bias(fmt, rows):
    layer, method, dequantized = quantized_layer(fmt, random_parts([128], 1024, seed=4))
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(128)
    check(run_kernel(layer, method, x, bias), x, dequantized, bias)


def test_inputs_the_kernels_do_not_take_run_the_reference():
    """A group that is not a power of two (int4) or a scale block of 96 columns (fp8) runs
    the reference, with the same result."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (32, 192), generator=generator, dtype=torch.uint8)
    words = int4_kernels.pack_int4_words(values)
    scale = torch.rand(2, 32, generator=generator) + 0.5
    zero = torch.randint(0, 16, (2, 32), generator=generator, dtype=torch.uint8)
    assert not int4_kernels.fits_int4_kernels(torch.empty(1, 192), words, scale, zero, 96)
    x = torch.randn(3, 192, generator=generator)
    expected = F.linear(x, int4_kernels.dequantize_int4_reference(words, scale, zero, 96))
    torch.testing.assert_close(int4_linear(x, words, scale, zero, 96), expected)
    weight = torch.randn(32, 192, generator=generator).to(torch.float8_e4m3fn)
    fp8_scale = torch.rand(1, 2, generator=generator)
    assert not fp8_kernels.fits_fp8_kernels(x, weight, fp8_scale, (32, 96))


def test_int4_words_round_trip_and_reference():
    """pack_int4_words puts input k of output n at bits 4 * (k % 8) of word [k // 8, n]
    (checked bit by bit), unpack_int4_words inverts it, and the reference dequantizes
    (q - zero) * scale per group, computed here by hand."""
    generator = torch.Generator().manual_seed(1)
    values = torch.randint(0, 16, (5, 24), generator=generator, dtype=torch.uint8)
    words = int4_kernels.pack_int4_words(values)
    assert words.shape == (3, 5) and words.dtype == torch.int32
    for n in range(5):
        for k in range(24):
            assert (int(words[k // 8, n]) >> (4 * (k % 8))) & 0xF == int(values[n, k])
    assert torch.equal(int4_kernels.unpack_int4_words(words), values)
    scale = torch.rand(3, 5, generator=generator) + 0.1
    zero = torch.randint(0, 16, (3, 5), generator=generator, dtype=torch.uint8)
    deq = int4_kernels.dequantize_int4_reference(words, scale, zero, 8)
    n, k = 3, 13
    assert deq[n, k].item() == pytest.approx(
        (values[n, k].item() - zero[1, n].item()) * scale[1, n].item()
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("group", [16, 32, 128, 1024])
@pytest.mark.parametrize("denormal", [True, False])
def test_int4_gemv_every_candidate_and_group(group, denormal, device):
    """The one-row GEMV on random words: every candidate tile of the CUDA tuner (tiles wider
    than the 200 outputs, splits of K, groups smaller and larger than a tile's word rows, one
    scale per output at 1024), both forms of the nibble (denormal float or 2^23 + q), with
    and without bias, against the reference."""
    generator = torch.Generator().manual_seed(group)
    rows, cols = 200, 1024
    values = torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.uint8)
    words = int4_kernels.pack_int4_words(values)
    groups = cols // min(group, cols)
    scale = (torch.rand(groups, rows, generator=generator) + 0.5) * 0.01
    zero = torch.randint(0, 16, (groups, rows), generator=generator, dtype=torch.uint8)
    x = torch.randn(1, cols, generator=generator).bfloat16()
    bias = torch.randn(rows, generator=generator).bfloat16()
    words, scale, zero, x, bias = (t.to(device) for t in (words, scale, zero, x, bias))
    dequantized = int4_kernels.dequantize_int4_reference(words, scale, zero, group)
    assert int4_kernels.fits_int4_kernels(x, words, scale, zero, group)
    for index, (config, waves) in enumerate(int4_kernels.int4_gemv_candidates()):
        b = bias if index % 2 else None
        out = int4_kernels.int4_gemv(x, words, scale, zero, group, b, config=config,
                                     waves=waves, denormal=denormal)  # fmt: skip
        check(out, x, dequantized, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_denormal_probe_agrees_with_torch(device):
    """The GEMV's probe (a Triton kernel on CUDA, numpy elsewhere) says what torch's own
    arithmetic on the device says of the denormal 2^-149 times 2^100 times 2^49."""
    tiny = torch.ones(1, dtype=torch.int32, device=device).view(torch.float32)
    kept = bool((tiny * 2.0**100 * 2.0**49 == 1.0).item())
    int4_kernels._keeps_denormals.cache_clear()
    assert int4_kernels._keeps_denormals(torch.device(device)) == kept


def test_int4_gemv_k_split_and_whole_match_the_reference():
    """fp32 x: the GEMV split 16 ways along K (float32 partial sums, then the split-sum
    kernel) and unsplit both equal the reference within fp32 rounding (1e-5 of the
    largest output)."""
    generator = torch.Generator().manual_seed(7)
    values = torch.randint(0, 16, (64, 2048), generator=generator, dtype=torch.uint8)
    words = int4_kernels.pack_int4_words(values)
    scale = torch.rand(16, 64, generator=generator) + 0.5
    zero = torch.full((16, 64), 8, dtype=torch.uint8)
    x = torch.randn(1, 2048, generator=generator)
    config = GemvConfig(64, 64, 4, 1)
    per_split, splits = int4_kernels.gemv_split(256, 64, config, 16.0, torch.device("cpu"))
    assert splits > 1 and per_split % 8 == 0
    split = int4_kernels.int4_gemv(x, words, scale, zero, 128, config=config, waves=16.0)
    whole = int4_kernels.int4_gemv(x, words, scale, zero, 128, config=config, waves=0.01)
    dequantized = int4_kernels.dequantize_int4_reference(words, scale, zero, 128)
    check(split, x, dequantized)
    check(whole, x, dequantized)


# -- GPU: the Llama-3.1-8B layer shapes, the layers' apply, graphs ---------------------------
LLAMA_8B_LAYERS = {  # name: (fused part sizes, in_features)
    "qkv": ([4096, 1024, 1024], 4096),
    "o": ([4096], 4096),
    "gate_up": ([14336, 14336], 4096),
    "down": ([4096], 14336),
}


@pytest.fixture(scope="module")
def gpu_layers():
    """Every (format, 8B layer) loaded once on the GPU (quantized on the CPU by the packer:
    the block formats loop per block, so the biggest layers are built from one 4096-row
    part repeated)."""
    cache = {}

    def get(fmt, name):
        if (fmt, name) not in cache:
            sizes, cols = LLAMA_8B_LAYERS[name]
            cache[fmt, name] = quantized_layer(fmt, random_parts(sizes, cols, 0), "cuda")
        return cache[fmt, name]

    return get


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["ct_fp8:channel", "ct_fp8:tensor", "deepseek_fp8:128x128"])
@pytest.mark.parametrize("name", list(LLAMA_8B_LAYERS))
def test_gpu_fp8_llama_8b_shapes(gpu_layers, fmt, name):
    layer, method, dequantized = gpu_layers(fmt, name)
    cols = dequantized.shape[1]
    for rows in (1, 2, 7, 16, 64, 300):
        x = torch.randn(rows, cols, device="cuda", generator=torch.Generator("cuda").manual_seed(
            rows)).bfloat16()  # fmt: skip
        out = run_kernel(layer, method, x)
        reference_x = x
        if rows > fp8_kernels.GEMV_MAX_ROWS and fp8_kernels._takes_scaled_mm(
            x, layer.weight, layer.weight_block
        ):  # FP8 tensor cores: x rounded to e4m3 per row first
            xq, x_scale = quantize_rows_fp8(x)
            reference_x = (xq.float() * x_scale).bfloat16()
        check(out, reference_x, dequantized, tolerance=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["gptq:group", "ct_int4:sym_channel", "awq:group"])
@pytest.mark.parametrize("name", list(LLAMA_8B_LAYERS))
def test_gpu_int4_llama_8b_shapes(gpu_layers, fmt, name):
    layer, method, dequantized = gpu_layers(fmt, name)
    cols = dequantized.shape[1]
    for rows in (1, 3, 16, 64, 300):
        x = torch.randn(rows, cols, device="cuda").bfloat16()
        check(run_kernel(layer, method, x), x, dequantized, tolerance=3e-2)


@pytest.mark.gpu
def test_gpu_scaled_mm_serves_many_rows_on_hopper():
    """On a GPU with FP8 tensor cores, more than 16 rows with per-row scales take
    torch._scaled_mm (and it did not fail over to the dot kernel)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    weight = torch.randn(512, 1024, device="cuda").to(torch.float8_e4m3fn)
    scale = torch.rand(512, 1, device="cuda") + 0.5
    x = torch.randn(64, 1024, device="cuda").bfloat16()
    assert fp8_kernels._takes_scaled_mm(x, weight, (1, 1024))
    fp8_linear(x, weight, scale, (1, 1024))
    assert x.device not in fp8_kernels._SCALED_MM_FAILED


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["ct_fp8:channel", "deepseek_fp8:128x128", "gptq:group"])
def test_gpu_apply_uses_the_kernels_and_replays_in_a_graph(fmt):
    """The linear method's apply on CUDA equals its reference (ATOM_QUANT_KERNELS=0 path)
    and replays under a CUDA graph at batch 1 and 8."""
    layer, method, dequantized = quantized_layer(fmt, random_parts([1024, 512], 2048, 5), "cuda")
    for rows in (1, 8):
        x = torch.randn(rows, 2048, device="cuda").bfloat16()
        eager = method.apply(layer, x)
        check(eager, x, dequantized, tolerance=3e-2)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            method.apply(layer, x)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = method.apply(layer, x)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured, eager, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows, cols", [(1, 384), (5, 5000), (33, 128)])
def test_quantize_rows_kernel_matches_its_reference(rows, cols, device):
    """The FP8 GEMM's activations: one scale per row, values rounded to e4m3."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)).bfloat16()
    x = x.to(device)
    x[0] *= 100  # rows of very different ranges
    q, scale = quantize_rows_fp8(x)
    q_ref, scale_ref = fp8_kernels.quantize_rows_fp8_reference(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (rows, 1)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    q, q_ref = q.float(), q_ref.float()
    same = q == q_ref
    if not x.is_cuda:  # Triton's interpreter rounds ties away from zero (42 -> 44) and drops
        # the carry when rounding up reaches the next power of two (126.8 -> 64); the GPU's
        # cvt.rn rounds as torch (to nearest even): exact there
        same |= ((q - q_ref).abs() <= q_ref.abs() / 8 + 2.0**-9) | (q * 2 == q_ref)
    assert bool(same.all()), (q[~same], q_ref[~same])
    assert (q_ref * scale - x.float()).abs().max() <= x.float().abs().max() / 16


@pytest.mark.parametrize("fmt", ["ct_fp8:channel", "deepseek_fp8:128x128"])
def test_every_gemv_tile_candidate_computes_the_same_product(fmt):
    """The FP8 tiles the CUDA tuner measures (quant_gemv_candidates around the GPU
    heuristic's, x in the tile's shape or broadcast once) all give the reference's product
    (int4's candidates: test_int4_gemv_every_candidate_and_group)."""
    layer, method, dequantized = quantized_layer(fmt, random_parts([48], 512, seed=9))
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    per_row = layer.weight_block[1] >= 512
    group = 0 if per_row else layer.weight_block[1]
    heuristic = quant_gemv_config(512, 48, "fp8", group, on_gpu=True,
                                  device=torch.device("cpu"))  # fmt: skip
    candidates = quant_gemv_candidates(heuristic, group)
    assert candidates[0] == (heuristic, True) and len(candidates) >= 4
    for config, variant in candidates:
        assert not group or config.block_k % group == 0
        out = fp8_kernels.fp8_gemv(x, layer.weight, layer.weight_scale, layer.weight_block,
                                   config=config, x_once=variant)  # fmt: skip
        check(out, x, dequantized)

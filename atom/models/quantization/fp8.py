"""FP8 e4m3 weights with float32 scales: read from a checkpoint, held, dequantized.

One checkpoint linear arrives as `weight` (float8_e4m3fn [N, K]) with either
compressed-tensors' `weight_scale` (one value, one per output row [N, 1], or one per
block [ceil(N/bn), ceil(K/bk)]) or DeepSeek's `weight_scale_inv` (per block); both are
multipliers: w = weight * scale.

A layer holds `weight` (fp8 [N, K]) and `weight_scale` (float32
[ceil(N/row_block), ceil(K/col_block)]): per-channel scales are blocks of one row by all of
the layer's inputs, a per-tensor scale is widened to per-row (fused q | k | v parts each keep
their own), and checkpoint blocks stay blocks unless a fused part or a shard starts inside
one (then blocks of one row). The torch reference dequantizes, then runs F.linear; a
kernel may replace `Fp8LinearMethod.apply` per shape (docs/quantization.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atom.forward_context import current_fusions
from atom.kernels.fp8_linear import fp8_linear
from atom.models.load_error import ModelLoadError
from atom.models.quantization.scheme import COMPRESSED_TENSORS, DEEPSEEK_FP8, QuantizationScheme

FP8_DTYPE = torch.float8_e4m3fn


def quant_kernels_enabled() -> bool:
    """The forward's ``Fusions.quant_kernels`` (ATOM_QUANT_KERNELS=0: the
    dequantize-then-F.linear reference on CUDA too, for A/B runs)."""
    return current_fusions().quant_kernels


@dataclass
class Fp8Weight:
    """One checkpoint linear in FP8: weight [N, K] fp8, scale float32 [ceil(N/rb), ceil(K/cb)]
    with `block` = (rb, cb)."""

    name: str
    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.scale, self.block).to(dtype)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
    """float32 [..., N, K] = weight * scale, each scale covering a (rows, cols) block."""
    rows, cols = weight.shape[-2:]
    full = scale.repeat_interleave(block[0], -2).narrow(-2, 0, rows)
    full = full.repeat_interleave(block[1], -1).narrow(-1, 0, cols)
    return weight.to(torch.float32) * full


def fp8_components(scheme: QuantizationScheme) -> tuple[set[str], set[str]]:
    """(required, optional) tensor name suffixes of one FP8 checkpoint linear."""
    scale = "weight_scale_inv" if scheme.layout == DEEPSEEK_FP8 else "weight_scale"
    required = {"weight", scale}
    if scheme.activations == "static":
        required.add("input_scale")
    return required, {"input_scale", "weight_zero_point"}


def read_fp8_weight(prefix: str, parts: dict, scheme: QuantizationScheme) -> Fp8Weight:
    """Check one linear's tensors (dtype, shape, finite scales) and return its Fp8Weight;
    ModelLoadError names the tensor that is wrong."""
    weight = parts["weight"]
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ModelLoadError(
            f"checkpoint tensor {prefix}.weight is {weight.dtype} {tuple(weight.shape)}; "
            f"{scheme.describe()} needs a 2-D {FP8_DTYPE}"
        )
    rows, cols = weight.shape
    scale_name = "weight_scale_inv" if scheme.layout == DEEPSEEK_FP8 else "weight_scale"
    scale = check_scale(f"{prefix}.{scale_name}", parts[scale_name])
    if scheme.block is not None:
        bn, bk = scheme.block
        expected, block = (-(-rows // bn), -(-cols // bk)), (bn, bk)
    elif scale.numel() == 1:  # per tensor: widened to one scale per row below
        expected, block = tuple(scale.shape), (1, cols)
    else:
        expected, block = (rows, 1), (1, cols)
        scale = scale[:, None] if scale.dim() == 1 else scale
    if tuple(scale.shape) != expected:
        raise ModelLoadError(
            f"checkpoint tensor {prefix}.{scale_name} has shape {tuple(scale.shape)}; "
            f"{scheme.describe()} of a [{rows}, {cols}] weight needs {expected}"
        )
    if scale.numel() == 1 and scheme.block is None:
        scale = scale.reshape(1, 1).expand(rows, 1)
    if "input_scale" in parts:
        check_scale(f"{prefix}.input_scale", parts["input_scale"])  # unused: weight-only
    zero = parts.get("weight_zero_point")
    if zero is not None and bool(zero.ne(0).any()):
        raise ModelLoadError(
            f"checkpoint tensor {prefix}.weight_zero_point is not zero (FP8 is symmetric)"
        )
    return Fp8Weight(prefix, weight, scale.to(torch.float32).contiguous(), block)


def check_scale(name: str, scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor must be floating, finite and not negative."""
    if not scale.is_floating_point() or scale.element_size() < 2:
        raise ModelLoadError(
            f"checkpoint tensor {name} is {scale.dtype}; scales are float16/bfloat16/float32"
        )
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ModelLoadError(f"checkpoint tensor {name} holds non-finite or negative scales")
    return scale


class Fp8LinearMethod:
    """Holds a layer's FP8 weight and scales and computes y = x @ dequantize(W)^T (+ b)."""

    def __init__(self, scheme: QuantizationScheme):
        self.scheme = scheme

    def create_weights(self, layer, rows: int, cols: int, row_starts: list[int], col_start: int):
        """Give `layer` its fp8 `weight` [rows, cols] and float32 `weight_scale`.

        row_starts: where each output part (and this rank's part of it) begins in the full
        checkpoint tensor and in the layer (fused parts); col_start: this rank's first input.
        Block scales stay blocks when every part and shard starts on a block boundary."""
        if self.scheme.block is None:
            block = (1, cols)
        else:
            bn, bk = self.scheme.block
            if col_start % bk:
                raise ModelLoadError(
                    f"{self.scheme.describe()}: a tensor-parallel shard starts at input {col_start}, "
                    f"inside a {bk}-column scale block; use a tensor-parallel size that splits "
                    "the inputs on block boundaries"
                )
            block = (bn if all(start % bn == 0 for start in row_starts) else 1, bk)
        layer.weight = torch.nn.Parameter(
            torch.empty(rows, cols, dtype=FP8_DTYPE), requires_grad=False
        )
        layer.weight_block = block
        scale_shape = (-(-rows // block[0]), -(-cols // block[1]))
        layer.register_buffer("weight_scale", torch.empty(scale_shape, dtype=torch.float32))

    def load(self, layer, source: Fp8Weight, dest_row: int, src_row: int, rows: int, src_col: int):
        """Copy rows [src_row, src_row + rows) and this layer's inputs from src_col of the
        checkpoint linear into the layer's rows from dest_row."""
        cols = layer.weight.shape[1]
        layer.weight.data.narrow(0, dest_row, rows).copy_(
            source.weight[src_row : src_row + rows, src_col : src_col + cols]
        )
        # the checkpoint's scale of each of the layer's blocks (its first row and input)
        rb, cb = layer.weight_block
        row_ids = torch.arange(src_row, src_row + rows, rb) // source.block[0]
        col_ids = torch.arange(src_col, src_col + cols, cb) // source.block[1]
        scale = source.scale[row_ids][:, col_ids]
        layer.weight_scale.narrow(0, dest_row // rb, scale.shape[0]).copy_(scale)

    def dequantize(self, layer, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(layer.weight, layer.weight_scale, layer.weight_block).to(dtype)

    def row_scale(self, layer) -> torch.Tensor | None:
        """The float32 [N, 1] scales of a layer with one scale per output row, which the
        fused batch-1 GEMVs take with the fp8 weight (atom/kernels/gemv.py); None for block
        scales (they keep the FP8 GEMV and the separate norm / rotary / SiLU kernels) or
        with the quantized kernels off (ATOM_QUANT_KERNELS=0: the reference's A/B runs)."""
        rows_per_scale, cols_per_scale = layer.weight_block
        per_row = rows_per_scale == 1 and cols_per_scale >= layer.weight.shape[1]
        return layer.weight_scale if per_row and quant_kernels_enabled() else None

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """On CUDA the FP8 kernels (atom/kernels/fp8_linear.py: the GEMV up to 16 rows,
        weight-only; more rows FP8 tensor cores with per-row dynamic activation scales where
        the scales are per row). Else the torch reference: dequantize, then F.linear, with
        compressed-tensors' dynamic per-token FP8 activations emulated (each row rounded to
        e4m3 with its own scale), as compressed-tensors and FP8 GEMMs do."""
        if x.is_cuda and quant_kernels_enabled():
            return fp8_linear(x, layer.weight, layer.weight_scale, layer.weight_block, bias)
        if self.scheme.layout == COMPRESSED_TENSORS and self.scheme.activations == "dynamic":
            x = fp8_round_per_token(x)
        return F.linear(x, self.dequantize(layer, x.dtype), bias)


def fp8_round_per_token(x: torch.Tensor) -> torch.Tensor:
    """x with each row quantized to e4m3 at scale amax(|row|) / 448, then dequantized."""
    finfo = torch.finfo(FP8_DTYPE)
    scale = x.abs().amax(dim=-1, keepdim=True).to(torch.float32) / finfo.max
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    scaled = (x.to(torch.float32) / scale).clamp(finfo.min, finfo.max)
    return (scaled.to(FP8_DTYPE).to(torch.float32) * scale).to(x.dtype)

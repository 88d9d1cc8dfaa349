"""int4 weights (w4a16) with group scales and zero points: read, held, dequantized.

Three checkpoint layouts of one linear W [N, K] (N outputs, K inputs), all with
w[n, k] = (q[n, k] - z[n, g]) * s[n, g], g = k // group_size:
- compressed-tensors `pack-quantized`: `weight_packed` int32 [N, K/8] (input k at bits
  4 * (k % 8) of word k // 8, stored q + 8), `weight_scale` [N, G], `weight_shape` [2],
  `weight_zero_point` int32 [N/8, G] packed along the outputs (asymmetric only; symmetric
  means z = 8 in the unsigned terms used here);
- GPTQ: `qweight` int32 [K/8, N] packed along the inputs, `qzeros` int32 [G, N/8] packed
  along the outputs (v1 `gptq` format: stored z - 1), `scales` [G, N], `g_idx` [K];
- AWQ (GEMM): `qweight` int32 [K, N/8] and `qzeros` [G, N/8] packed along the outputs in
  the order 0, 2, 4, 6, 1, 3, 5, 7, `scales` [G, N].

A layer holds `weight` (int32 [K/8, N], GPTQ's layout: input k of output n at bits
4 * (k % 8) of word [k // 8, n]; outputs contiguous, which the batch-1 GEMV reads in
consecutive threads), `weight_scale` (float32 [G, N]) and `weight_zero_point` (uint8 [G, N]).
The torch reference dequantizes, then runs F.linear; a kernel may replace
`Int4LinearMethod.apply` per shape (docs/quantization.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atom.kernels.int4_linear import dequantize_int4_reference, int4_linear, pack_int4_words
from atom.models.load_error import ModelLoadError
from atom.models.quantization.fp8 import check_scale, quant_kernels_enabled
from atom.models.quantization.scheme import COMPRESSED_TENSORS, GPTQ, QuantizationScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output 8w + AWQ_ORDER[i]
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass
class Int4Weight:
    """One checkpoint linear in int4: values uint8 [N, K] in [0, 16), scale [N, G],
    zero uint8 [N, G], `group` inputs per scale."""

    name: str
    values: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        cols = self.values.shape[1]
        zero = self.zero.to(torch.float32).repeat_interleave(self.group, 1)[:, :cols]
        scale = self.scale.to(torch.float32).repeat_interleave(self.group, 1)[:, :cols]
        return ((self.values.to(torch.float32) - zero) * scale).to(dtype)


def unpack_words(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (low bits first), spread along `dim`."""
    nibbles = (words.unsqueeze(-1) >> SHIFTS.to(words.device)) & 0xF  # [..., 8]
    nibbles = nibbles.movedim(-1, dim + 1) if dim != words.dim() - 1 else nibbles
    shape = list(words.shape)
    shape[dim] *= 8
    return nibbles.reshape(shape).to(torch.uint8)


def int4_components(scheme: QuantizationScheme) -> tuple[set[str], set[str]]:
    """(required, optional) tensor name suffixes of one int4 checkpoint linear."""
    if scheme.layout == COMPRESSED_TENSORS:
        required = {"weight_packed", "weight_scale", "weight_shape"}
        return (required | ({"weight_zero_point"} if not scheme.symmetric else set())), set()
    if scheme.layout == GPTQ:
        return {"qweight", "qzeros", "scales"}, {"g_idx"}
    return {"qweight", "qzeros", "scales"}, set()


def _expect(name: str, tensor: torch.Tensor, dtype, shape, scheme) -> None:
    if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
        raise ModelLoadError(
            f"checkpoint tensor {name} is {tensor.dtype} {tuple(tensor.shape)}; "
            f"{scheme.describe()} needs {dtype} {tuple(shape)}"
        )


def read_int4_weight(prefix: str, parts: dict, scheme: QuantizationScheme) -> Int4Weight:
    """Unpack one linear's tensors into an Int4Weight; ModelLoadError names a tensor that
    is missing a part, has the wrong dtype or shape, or holds non-finite scales."""
    if scheme.layout == COMPRESSED_TENSORS:
        return _compressed_tensors(prefix, parts, scheme)
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ModelLoadError(
            f"checkpoint tensor {prefix}.qweight is {qweight.dtype} "
            f"{tuple(qweight.shape)}; {scheme.describe()} needs 2-D int32"
        )
    if scheme.layout == GPTQ:
        rows, cols = qweight.shape[1], qweight.shape[0] * 8
        values = unpack_words(qweight, 0).t()  # [K, N] -> [N, K]
    else:
        rows, cols = qweight.shape[1] * 8, qweight.shape[0]
        values = _awq_unpack(qweight).t()
    group = scheme.group_size or cols
    groups = -(-cols // group)
    _expect(f"{prefix}.scales", scales, scales.dtype, (groups, rows), scheme)
    check_scale(f"{prefix}.scales", scales)
    _expect(f"{prefix}.qzeros", qzeros, torch.int32, (groups, rows // 8), scheme)
    zero = (unpack_words(qzeros, 1) if scheme.layout == GPTQ else _awq_unpack(qzeros)).t()
    zero = (zero.to(torch.int32) + scheme.zero_offset).to(torch.uint8)
    if bool((zero > 15).any()):
        raise ModelLoadError(f"checkpoint tensor {prefix}.qzeros holds zero points above 15")
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        trivial = torch.arange(cols, dtype=torch.int64) // group
        if tuple(g_idx.shape) != (cols,) or not torch.equal(g_idx.to(torch.int64), trivial):
            raise ModelLoadError(
                f"checkpoint tensor {prefix}.g_idx is not arange(K) // group_size: act-order "
                "(desc_act) checkpoints are not supported"
            )
    return Int4Weight(
        prefix, values.contiguous(), scales.t().contiguous(), zero.contiguous(), group
    )


def _awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """AWQ words [R, C/8] -> values [R, C] in output order."""
    nibbles = (words.unsqueeze(-1) >> SHIFTS.to(words.device)) & 0xF  # [R, C/8, 8] in pack order
    inverse = [AWQ_ORDER.index(i) for i in range(8)]
    return nibbles[..., inverse].reshape(words.shape[0], -1).to(torch.uint8)


def _compressed_tensors(prefix: str, parts: dict, scheme: QuantizationScheme) -> Int4Weight:
    shape = parts["weight_shape"]
    if shape.dtype.is_floating_point or tuple(shape.shape) != (2,):
        raise ModelLoadError(f"checkpoint tensor {prefix}.weight_shape is not two integers")
    rows, cols = (int(v) for v in shape.tolist())
    if cols % 8:
        raise ModelLoadError(f"{prefix}: {cols} inputs; int4 loading needs a multiple of 8")
    _expect(
        f"{prefix}.weight_packed", parts["weight_packed"], torch.int32, (rows, cols // 8), scheme
    )
    values = unpack_words(parts["weight_packed"], 1)
    group = scheme.group_size or cols
    groups = -(-cols // group)
    scale = parts["weight_scale"]
    _expect(f"{prefix}.weight_scale", scale, scale.dtype, (rows, groups), scheme)
    check_scale(f"{prefix}.weight_scale", scale)
    if scheme.symmetric:
        zero = torch.full((rows, groups), 8, dtype=torch.uint8)
    else:
        packed_zero = parts["weight_zero_point"]
        _expect(f"{prefix}.weight_zero_point", packed_zero, torch.int32,
                (-(-rows // 8), groups), scheme)  # fmt: skip
        zero = unpack_words(packed_zero.t().contiguous(), 1).t()[:rows].contiguous()
    return Int4Weight(prefix, values, scale.contiguous(), zero, group)


class Int4LinearMethod:
    """Holds a layer's packed int4 weight, scales and zero points; y = x @ dequantize(W)^T."""

    def __init__(self, scheme: QuantizationScheme):
        self.scheme = scheme

    def create_weights(self, layer, rows: int, cols: int, row_starts: list[int], col_start: int):
        """Give `layer` `weight` int32 [cols/8, rows], `weight_scale` [G, rows] and
        `weight_zero_point` uint8 [G, rows]; a shard must start on a group boundary."""
        group = self.scheme.group_size or cols
        if col_start % group or cols % 8:
            raise ModelLoadError(
                f"{self.scheme.describe()}: a tensor-parallel shard of {cols} inputs starting "
                f"at {col_start} splits a group of {group} or is not a multiple of 8 inputs; "
                "use a tensor-parallel size that splits the inputs on group boundaries"
            )
        groups = -(-cols // group)
        layer.weight = torch.nn.Parameter(
            torch.empty(cols // 8, rows, dtype=torch.int32), requires_grad=False
        )
        layer.weight_group = group
        layer.register_buffer("weight_scale", torch.empty(groups, rows, dtype=torch.float32))
        layer.register_buffer("weight_zero_point", torch.empty(groups, rows, dtype=torch.uint8))

    def load(self, layer, source: Int4Weight, dest_row: int, src_row: int, rows: int, src_col: int):
        cols = layer.weight.shape[0] * 8
        values = source.values[src_row : src_row + rows, src_col : src_col + cols]
        layer.weight.data.narrow(1, dest_row, rows).copy_(pack_int4_words(values))
        group_ids = torch.arange(src_col, src_col + cols, layer.weight_group) // source.group
        scale = source.scale[src_row : src_row + rows][:, group_ids]
        zero = source.zero[src_row : src_row + rows][:, group_ids]
        layer.weight_scale.narrow(1, dest_row, rows).copy_(scale.t())
        layer.weight_zero_point.narrow(1, dest_row, rows).copy_(zero.t())

    def dequantize(self, layer, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4_reference(
            layer.weight, layer.weight_scale, layer.weight_zero_point, layer.weight_group
        ).to(dtype)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """On CUDA the int4 kernels (atom/kernels/int4_linear.py: the GEMV at one row, the
        dot kernel for more); else the torch reference: dequantize, then F.linear."""
        if x.is_cuda and quant_kernels_enabled():
            return int4_linear(
                x, layer.weight, layer.weight_scale, layer.weight_zero_point,
                layer.weight_group, bias,
            )  # fmt: skip
        return F.linear(x, self.dequantize(layer, x.dtype), bias)

"""Routed experts of an FP8 checkpoint (DeepSeek-V2/V3/V4), held in FP8 with their scales.

`Fp8Experts` replaces the stacked dense experts of a MoE layer: `gate_up_proj` float8_e4m3fn
[E, 2I, H] (gate rows then up rows) and `down_proj` [E, H, I], with float32 scales per block
(`gate_up_scale`, `down_scale`; blocks as fp8.py: the checkpoint's, or one row high where the
up rows start inside a block). On the CUDA path atom/models/moe.py's `routed_experts` takes
the FP8 weights with `fp8_scales()` and its grouped kernels dequantize each tile as they read
it (atom/kernels/moe.py). `dense(ids, dtype)` hands the torch reference dense weights: on
CPU only the experts the step routes to (ids renumbered in expert order, so the reference
runs the same GEMMs in the same order); on CUDA (ATOM_QUANT_KERNELS=0's A/B runs) all of
them, without a host sync, so graph capture stays possible.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from atom.kernels.moe import Fp8Scales
from atom.models.load_error import ModelLoadError, check_shape
from atom.models.quantization.fp8 import FP8_DTYPE, Fp8LinearMethod, Fp8Weight, dequantize_fp8
from atom.models.quantization.scheme import QuantizationScheme


class Fp8Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, scheme: QuantizationScheme):
        super().__init__()
        self.method = Fp8LinearMethod(scheme)
        self.inter = inter
        bn, bk = scheme.block or (1, None)
        self.gate_up_block = (bn if inter % bn == 0 else 1, bk or hidden)
        self.down_block = (bn, bk or inter)
        self.gate_up_proj = self._weight(num_experts, 2 * inter, hidden)
        self.down_proj = self._weight(num_experts, hidden, inter)
        self.register_buffer("gate_up_scale", self._scale(num_experts, 2 * inter, hidden, True))
        self.register_buffer("down_scale", self._scale(num_experts, hidden, inter, False))

    @staticmethod
    def _weight(experts: int, rows: int, cols: int) -> nn.Parameter:
        return nn.Parameter(torch.empty(experts, rows, cols, dtype=FP8_DTYPE), requires_grad=False)

    def _scale(self, experts: int, rows: int, cols: int, gate_up: bool) -> torch.Tensor:
        rb, cb = self.gate_up_block if gate_up else self.down_block
        return torch.empty(experts, -(-rows // rb), -(-cols // cb), dtype=torch.float32)

    def expert_weight(self, tensor, name: str, part: str) -> Fp8Weight:
        """The checkpoint tensor `name`, one expert's `part` (`gate_proj`, `up_proj` or
        `down_proj`), checked: an Fp8Weight of that shape, else refused naming it."""
        if not isinstance(tensor, Fp8Weight):
            raise ModelLoadError(
                f"checkpoint tensor {name!r} is a plain {tensor.dtype} tensor where the "
                f"checkpoint's quantization_config says {self.method.scheme.describe()}"
            )
        hidden = self.down_proj.shape[1]
        expected = (hidden, self.inter) if part == "down_proj" else (self.inter, hidden)
        check_shape(tensor, expected, name)
        return tensor

    def load(self, expert: int, part: str, weight: Fp8Weight) -> None:
        """Copy one checkpoint expert linear (`gate_proj`, `up_proj` or `down_proj`) in."""
        if part == "down_proj":
            view = SimpleNamespace(
                weight=self.down_proj[expert],
                weight_scale=self.down_scale[expert],
                weight_block=self.down_block,
            )
            self.method.load(view, weight, 0, 0, weight.shape[0], 0)
            return
        view = SimpleNamespace(
            weight=self.gate_up_proj[expert],
            weight_scale=self.gate_up_scale[expert],
            weight_block=self.gate_up_block,
        )
        start = 0 if part == "gate_proj" else self.inter
        self.method.load(view, weight, start, 0, self.inter, 0)

    def fp8_scales(self) -> Fp8Scales:
        """The scales and blocks of `gate_up_proj` and `down_proj`, for the fused kernels."""
        return Fp8Scales(self.gate_up_scale, self.down_scale, self.gate_up_block, self.down_block)

    def dense(self, ids: torch.Tensor, dtype: torch.dtype):
        """(gate_up [U, 2I, H], down [U, H, I], ids renumbered into them) in `dtype`."""
        if ids.is_cuda:
            used = None
            gate_up, gate_up_scale = self.gate_up_proj, self.gate_up_scale
            down, down_scale = self.down_proj, self.down_scale
        else:
            used, ids_in_used = torch.unique(ids, return_inverse=True)
            gate_up, gate_up_scale = self.gate_up_proj[used], self.gate_up_scale[used]
            down, down_scale = self.down_proj[used], self.down_scale[used]
            ids = ids_in_used
        gate_up = dequantize_fp8(gate_up, gate_up_scale, self.gate_up_block).to(dtype)
        down = dequantize_fp8(down, down_scale, self.down_block).to(dtype)
        return gate_up, down, ids

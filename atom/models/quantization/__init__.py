"""Quantized checkpoints: FP8 and int4 weights loaded as users ship them (docs/quantization.md).

- scheme.py reads config.json's `quantization_config` into a QuantizationScheme (or refuses it);
- checkpoint.py gathers each quantized linear's tensors from the weight stream;
- fp8.py / int4.py check and hold the weights and run the dequantize-then-matmul reference
  (`Fp8LinearMethod` / `Int4LinearMethod`, one object per layer; a kernel replaces `apply`).
"""

from __future__ import annotations

from atom.models.quantization.checkpoint import SHARD_END, QuantizedWeight, QuantizedWeightStream
from atom.models.quantization.fp8 import Fp8LinearMethod, Fp8Weight
from atom.models.quantization.int4 import Int4LinearMethod, Int4Weight
from atom.models.quantization.scheme import FP8, QuantizationScheme, read_quantization_scheme

__all__ = [
    "SHARD_END",
    "Fp8LinearMethod",
    "Fp8Weight",
    "Int4LinearMethod",
    "Int4Weight",
    "QuantizationScheme",
    "QuantizedWeight",
    "QuantizedWeightStream",
    "linear_method",
    "read_quantization_scheme",
]


def linear_method(scheme: QuantizationScheme) -> Fp8LinearMethod | Int4LinearMethod:
    """A layer's method for `scheme`: where it keeps its weights and how it multiplies."""
    return Fp8LinearMethod(scheme) if scheme.kind == FP8 else Int4LinearMethod(scheme)

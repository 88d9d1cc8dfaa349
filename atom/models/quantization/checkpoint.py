"""Gather a quantized linear's checkpoint tensors into one weight, as the stream goes by.

A quantized linear is stored as several tensors (`q_proj.weight` + `q_proj.weight_scale`,
or `q_proj.qweight` + `qzeros` + `scales` + `g_idx`, ...). `QuantizedWeightStream` holds
them until the linear is whole, checks them, and yields one `<linear>.weight` entry: an
Fp8Weight or Int4Weight the model loads like a tensor (parallel_layers.load_parameter).
Everything else passes through untouched. Pieces are held at most until the end of the
safetensors shard after the one they came from; a linear still missing a piece when the
stream ends is refused, naming the missing tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from atom.models.load_error import ModelLoadError
from atom.models.quantization.fp8 import FP8_DTYPE, Fp8Weight, fp8_components, read_fp8_weight
from atom.models.quantization.int4 import Int4Weight, int4_components, read_int4_weight
from atom.models.quantization.scheme import FP8, QuantizationScheme

QuantizedWeight = Fp8Weight | Int4Weight
SHARD_END = object()  # marks the end of a safetensors shard in the raw stream


class QuantizedWeightStream:
    """Turns (name, tensor) pairs (with SHARD_END between shards) into (name, tensor or
    quantized weight) pairs for `scheme`."""

    def __init__(self, scheme: QuantizationScheme):
        self.scheme = scheme
        components = fp8_components if scheme.kind == FP8 else int4_components
        self.required, self.optional = components(scheme)
        self.read = read_fp8_weight if scheme.kind == FP8 else read_int4_weight
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def _piece(self, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        prefix, _, suffix = name.rpartition(".")
        if suffix not in self.required | self.optional:
            return None
        if suffix == "weight" and tensor.dtype != FP8_DTYPE:
            return None  # a linear left unquantized (ignore list), or the dtype check later
        return prefix, suffix

    def __call__(self, raw: Iterable) -> Iterator[tuple[str, object]]:
        for item in raw:
            if item is SHARD_END:
                yield from self._flush(final=False)
                continue
            name, tensor = item
            piece = self._piece(name, tensor)
            if piece is None:
                if name.endswith(".weight") and name[: -len(".weight")] in self.pending:
                    # e.g. a bf16 weight where the scales say FP8: the dtype check names it
                    self.pending[name[: -len(".weight")]]["weight"] = tensor
                    continue
                yield name, tensor
                continue
            prefix, suffix = piece
            self.pending.setdefault(prefix, {})[suffix] = tensor
        yield from self._flush(final=True)

    def _flush(self, final: bool) -> Iterator[tuple[str, QuantizedWeight]]:
        for prefix in list(self.pending):
            parts = self.pending[prefix]
            missing = sorted(self.required - parts.keys())
            if missing:
                if final:
                    raise ModelLoadError(
                        f"checkpoint tensor {prefix}.{missing[0]} is missing "
                        f"({self.scheme.describe()}; found {', '.join(sorted(parts))})"
                    )
                continue
            del self.pending[prefix]
            yield f"{prefix}.weight", self.read(prefix, parts, self.scheme)

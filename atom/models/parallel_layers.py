"""Tensor-parallel linear layers, vocabulary-parallel embedding and LM head.

Megatron's split: a column-parallel layer keeps a slice of the output features (its
output stays sharded, no communication); a row-parallel layer keeps the matching slice
of the input features and sums the partial products over the ranks (one all-reduce).
Attention is column-parallel over heads (qkv) then row-parallel (o_proj); the MLP is
column-parallel (gate_up) then row-parallel (down_proj). With one rank every layer is
the plain matmul / embedding lookup, bit for bit.

Each parameter carries a `weight_loader(param, tensor, shard_id, name)` that copies only
this rank's part of a full checkpoint tensor; `load_parameter` dispatches to it.

A quantized checkpoint (atom/models/quantization/) gives the linear layers a linear method
at construction (`quant_method`, from `linear_method_for`): the layer's `weight` is then the
stored FP8 or packed int4 tensor with its scales beside it (no dense weight is ever
allocated), sharded like the dense weight, and `forward` is the method's `apply`. A
quantized checkpoint tensor bound for a dense parameter is dequantized. On CPU
(`Config.cpu_linear="packed"`) a dense linear layer's weight also carries `cpu_packed`, the
same weight packed once for oneDNN (atom/kernels/cpu_linear.py; `pack_cpu_weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.distributed import TensorParallelGroup, shard_range
from atom.forward_context import current_fusions
from atom.kernels.cpu_linear import PackedLinearWeight, can_pack
from atom.kernels.gemv import gemv
from atom.kernels.gemv_policy import use_gemv
from atom.models.load_error import ModelLoadError, check_shape
from atom.models.quantization import QuantizationScheme, QuantizedWeight, linear_method


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear; on CUDA with `Fusions.gemv_linear` and one row (batch-1 decode), the
    Triton GEMV of atom/kernels/gemv.py instead where the GEMV policy measured it faster
    for this shape (atom/kernels/gemv_policy.py `use_gemv`); on CPU with a packed weight
    (`pack_cpu_weights`), oneDNN's product on it."""
    packed = getattr(weight, "cpu_packed", None)
    if packed is not None:
        return packed(x, bias)
    if x.is_cuda and current_fusions().gemv_linear and use_gemv(x, weight, bias=bias):
        return gemv(x, weight, bias=bias)
    return F.linear(x, weight, bias)


def load_parameter(param: nn.Parameter, tensor: torch.Tensor, shard_id, name: str) -> None:
    """Copy the checkpoint tensor `name` (full, unsharded) into `param` (this rank's part)."""
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, tensor, shard_id, name)
    else:
        tensor = dense(tensor, param.dtype)
        check_shape(tensor, param.shape, name)
        param.data.copy_(tensor)


def dense(tensor, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor for a dense parameter: a quantized weight is dequantized."""
    return tensor.dequantize(dtype) if isinstance(tensor, QuantizedWeight) else tensor


def _quantized(layer, tensor, name: str):
    if not isinstance(tensor, QuantizedWeight):
        raise ModelLoadError(
            f"checkpoint tensor {name!r} is a plain {tensor.dtype} tensor where the "
            f"checkpoint's quantization_config says {layer.quant_method.scheme.describe()}"
        )
    return tensor


def linear_method_for(scheme: QuantizationScheme | None, names: list[str], layer: str):
    """The linear method of a layer holding the HF linears `names` (one, or the parts of a
    fused layer such as q_proj, k_proj, v_proj), or None when `scheme` leaves them dense.
    A fused layer is quantized whole: an ignore list that keeps only some parts dense is
    refused, naming the layer."""
    if scheme is None:
        return None
    quantized = {scheme.quantizes(name) for name in names}
    if len(quantized) > 1:
        raise ModelLoadError(
            f"quantization_config ignore list {list(scheme.ignore)} keeps some of {names} "
            f"unquantized; atom fuses them into one layer ({layer})"
        )
    return linear_method(scheme) if quantized.pop() else None


def checkpoint_linear(scheme, name: str, in_features: int, out_features: int, bias: bool):
    """nn.Linear, or where the quantized checkpoint `scheme` quantizes the HF linear `name`
    (e.g. model.layers.0.self_attn.o_proj) a one-part ColumnParallelLinear holding its FP8 /
    int4 weight (DeepSeek-V2/V3/V4's projections). Call it through `project`."""
    method = linear_method_for(scheme, [name], name)
    if method is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, [out_features], bias, quant_method=method)


def project(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x through `layer`, an nn.Linear or a ColumnParallelLinear (dense or quantized): a
    dense weight through `linear` (the batch-1 GEMV policy, a packed CPU weight), a quantized
    one through its linear method."""
    if isinstance(layer, ColumnParallelLinear):
        return layer(x)
    return linear(x, layer.weight, layer.bias)


def _single(tp: TensorParallelGroup | None) -> TensorParallelGroup:
    return tp if tp is not None else TensorParallelGroup.single()


class ColumnParallelLinear(nn.Module):
    """y[..., local outputs] = x @ W_local^T (+ b_local); the output stays sharded.

    The output is the concatenation of `output_sizes` parts (one part for a plain layer;
    gate | up, or q | k | v when fused). Each part is split evenly over the ranks and a
    rank keeps its slice of every part, side by side, so the fused layer still splits
    into whole local parts (e.g. this rank's q heads, then its k heads, then its v heads).
    `part_units` (default 1) is the granularity a part may be cut at: the head size for
    q/k/v, so no head is ever split.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        tp: TensorParallelGroup | None = None,
        part_names: list | None = None,
        part_units: int = 1,
        quant_method=None,
    ):
        super().__init__()
        self.tp = tp = _single(tp)
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.part_names = list(part_names) if part_names is not None else None
        self.local_sizes = []
        for index, size in enumerate(self.output_sizes):
            label = f"output part {self._name(index)} ({size // part_units} units of {part_units})"
            _, units = shard_range(size // part_units, tp.rank, tp.world_size, label)
            self.local_sizes.append(units * part_units)
        # quant_method (Fp8LinearMethod, Int4LinearMethod): it creates `weight` and its scales
        self.quant_method = quant_method
        if quant_method is None:
            self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), input_size))
        else:
            row_starts = []  # where each part begins in the layer and in the checkpoint
            for part, local in enumerate(self.local_sizes):
                row_starts += [sum(self.local_sizes[:part]), tp.rank * local]
            quant_method.create_weights(self, sum(self.local_sizes), input_size, row_starts, 0)
        self.weight.weight_loader = self._load
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)))
            self.bias.weight_loader = self._load

    def _name(self, index: int):
        return self.part_names[index] if self.part_names is not None else index

    def _part_index(self, shard_id) -> int:
        if shard_id is None:
            if len(self.output_sizes) != 1:
                raise ValueError("a fused layer loads its parts one at a time (shard id needed)")
            return 0
        if self.part_names is not None:
            return self.part_names.index(shard_id)
        return int(shard_id)

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard_id, name: str) -> None:
        part = self._part_index(shard_id)
        full = self.output_sizes[part]
        local = self.local_sizes[part]
        offset = sum(self.local_sizes[:part])
        if self.quant_method is not None and param is self.weight:
            tensor = _quantized(self, tensor, name)
            check_shape(tensor, (full, self.input_size), name)
            self.quant_method.load(self, tensor, offset, self.tp.rank * local, local, 0)
            return
        tensor = dense(tensor, param.dtype)
        expected = (full, self.input_size) if param.dim() == 2 else (full,)
        check_shape(tensor, expected, name)
        param.data.narrow(0, offset, local).copy_(tensor.narrow(0, self.tp.rank * local, local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return linear(x, self.weight, self.bias)


class LayerPart:
    """A checkpoint linear that loads through its layer's weight loader (a quantized layer:
    the FP8 / int4 weight and its scales are written together): `part` is its name in a
    stacked layer (`part_names`), None for a one-part layer."""

    def __init__(self, layer: ColumnParallelLinear, part: str | None):
        self.layer, self.part = layer, part

    def load(self, tensor, name: str) -> None:
        load_parameter(self.layer.weight, tensor, self.part, name)


def part_targets(model: nn.Module, targets: dict) -> None:
    """For a loader that copies checkpoint tensors by module name (DeepSeek-V4 / V4.1):
    in `targets` (name -> tensor), replace each one-rank dense ColumnParallelLinear with
    `part_names` by its parts, `<parent>.<part name>.weight` -> the part's rows of the
    weight (a view), so a checkpoint that keeps the parts apart loads into the fused
    layer (and a missing part is still reported by its own name). A quantized
    ColumnParallelLinear (its weight and scales) becomes a LayerPart per part instead
    (`<name>.weight` for a one-part layer), which the loader calls with the checkpoint's
    Fp8Weight / Int4Weight."""
    for name, module in model.named_modules():
        if not isinstance(module, ColumnParallelLinear):
            continue
        assert module.tp.world_size == 1 and module.bias is None
        parent = name.rsplit(".", 1)[0] + "." if "." in name else ""
        if module.quant_method is not None:
            targets.pop(f"{name}.weight")
            for buffer, _ in module.named_buffers(recurse=False):
                targets.pop(f"{name}.{buffer}")
            if module.part_names is None:
                targets[f"{name}.weight"] = LayerPart(module, None)
            for part in module.part_names or ():
                targets[f"{parent}{part}.weight"] = LayerPart(module, part)
            continue
        if module.part_names is None:
            continue
        targets.pop(f"{name}.weight")
        offset = 0
        for part, rows in zip(module.part_names, module.local_sizes, strict=True):
            targets[f"{parent}{part}.weight"] = module.weight.data.narrow(0, offset, rows)
            offset += rows


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q | k | v projection split by heads: each rank keeps num_heads / N query heads
    and num_kv_heads / N key/value heads (GQA groups stay whole: local query head i reads
    local KV head i // group on every rank)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallelGroup | None = None,
        quant_method=None,
    ):
        tp = _single(tp)
        shard_range(num_heads, tp.rank, tp.world_size, "num_attention_heads")
        shard_range(num_kv_heads, tp.rank, tp.world_size, "num_key_value_heads")
        super().__init__(
            hidden_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias,
            tp,
            part_names=["q", "k", "v"],
            part_units=head_dim,
            quant_method=quant_method,
        )
        self.num_heads = num_heads // tp.world_size
        self.num_kv_heads = num_kv_heads // tp.world_size


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) (+ b): the input arrives sharded (the output
    of a column-parallel layer), the output is whole on every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp: TensorParallelGroup | None = None,
        quant_method=None,
    ):
        super().__init__()
        self.tp = tp = _single(tp)
        self.input_size = input_size
        self.output_size = output_size
        _, self.local_input = shard_range(input_size, tp.rank, tp.world_size, "input features")
        # quant_method (Fp8LinearMethod, Int4LinearMethod): it creates `weight` and its scales
        self.quant_method = quant_method
        if quant_method is None:
            self.weight = nn.Parameter(torch.empty(output_size, self.local_input))
        else:
            start = tp.rank * self.local_input
            quant_method.create_weights(self, output_size, self.local_input, [0], start)
        self.weight.weight_loader = self._load_weight
        # The bias is added once, after the sum, so it is kept whole on every rank.
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def _load_weight(self, param, tensor, shard_id, name) -> None:
        start = self.tp.rank * self.local_input
        if self.quant_method is not None:
            tensor = _quantized(self, tensor, name)
            check_shape(tensor, (self.output_size, self.input_size), name)
            self.quant_method.load(self, tensor, 0, 0, self.output_size, start)
            return
        tensor = dense(tensor, param.dtype)
        check_shape(tensor, (self.output_size, self.input_size), name)
        param.data.copy_(tensor.narrow(1, start, self.local_input))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            y = self.tp.all_reduce(self.quant_method.apply(self, x))
            return y if self.bias is None else y + self.bias
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (token ids) are split over the ranks.

    The vocabulary is padded to a multiple of the world size; rank r keeps ids
    [r * V/N, (r+1) * V/N). A rank looks up the ids it owns, writes zeros for the others,
    and one all-reduce assembles the rows (adding zeros is exact).
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup | None = None):
        super().__init__()
        self.tp = tp = _single(tp)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.rows_per_rank = -(-vocab_size // tp.world_size)
        self.start = tp.rank * self.rows_per_rank
        self.end = self.start + self.rows_per_rank  # may exceed vocab_size (padding rows)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))
        self.weight.weight_loader = self._load

    def _load(self, param, tensor, shard_id, name) -> None:
        tensor = dense(tensor, param.dtype)
        check_shape(tensor, (self.vocab_size, self.hidden_size), name)
        valid = max(0, min(self.end, self.vocab_size) - self.start)
        param.data[:valid].copy_(tensor[self.start : self.start + valid])
        param.data[valid:].zero_()  # padding rows: never looked up, logits trimmed away

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.start) & (input_ids < self.end)
        local_ids = torch.where(owned, input_ids - self.start, 0)
        rows = F.embedding(local_ids, self.weight)
        rows = rows.masked_fill(~owned.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(rows)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over the vocabulary, split like VocabParallelEmbedding (so a tied
    head shares the embedding's shard). Logits are gathered on rank 0, which samples."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local = linear(hidden, self.weight)
        logits = self.tp.gather_to_first(local, dim=-1)
        if logits is None or logits.shape[-1] == self.vocab_size:
            return logits
        return logits[..., : self.vocab_size]


def pack_cpu_weights(model: nn.Module) -> int:
    """Pack the weight of every linear layer and LM head of `model` for oneDNN (once, after
    the weights are loaded; atom/kernels/cpu_linear.py). A tied LM head packs the embedding
    table beside itself: the lookup keeps the dense table. Returns the weights packed."""
    packed = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            weight = module.weight
            if can_pack(weight) and getattr(weight, "cpu_packed", None) is None:
                weight.cpu_packed = PackedLinearWeight(weight)
                packed += 1
    return packed

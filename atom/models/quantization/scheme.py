"""Read a checkpoint's `quantization_config` (config.json) into one QuantizationScheme.

Four families of config, each refused key by key where atom does not run it
(docs/quantization.md lists what is accepted):
- compressed-tensors (`quant_method: "compressed-tensors"`): `float-quantized` (FP8 e4m3
  weights, per-tensor / per-channel / block scales) and `pack-quantized` (int4 weights,
  per-channel or group scales, symmetric or with zero points);
- GPTQ and AWQ (`quant_method: "gptq"` / `"awq"`): int4 in their classic packed layouts;
- DeepSeek's native FP8 (`quant_method: "fp8"`, `weight_block_size`, `weight_scale_inv`;
  float32 scales and FP8 experts: no ue8m0 scales, no FP4 experts).

The weights stay quantized in memory and are dequantized in the linear layer
(atom/models/quantization/fp8.py, int4.py). compressed-tensors' dynamic per-token FP8
activations are emulated (rounded to e4m3 per row, as compressed-tensors does); static input
scales and DeepSeek's activation scheme are checked and not applied (weight-only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from atom.models.load_error import ModelLoadError

FP8 = "fp8"
INT4 = "int4"

# Where the int4 values, scales and zero points come from (their packing differs).
COMPRESSED_TENSORS = "compressed-tensors"
GPTQ = "gptq"
AWQ = "awq"
DEEPSEEK_FP8 = "fp8"


@dataclass(frozen=True)
class QuantizationScheme:
    """How a checkpoint's linear weights are stored.

    kind: FP8 or INT4. layout: COMPRESSED_TENSORS, GPTQ, AWQ or DEEPSEEK_FP8 (the tensor
    names and packing). fp8: `block` (rows, cols) of one scale, or None for one scale per
    output row (per-tensor scales are widened to per-row at load). int4: `group_size`
    input features per scale (None: one per output row over all inputs), `symmetric`
    (no zero points stored), `zero_offset` (GPTQ v1 stores zero - 1).
    `ignore`: HF module names or `re:` patterns left unquantized (lm_head, ...).
    `activations`: the activation scheme as written ("dynamic", "static" or None);
    compressed-tensors' "dynamic" (per token) is emulated, the others run weight-only.
    """

    kind: str
    layout: str
    block: tuple[int, int] | None = None
    group_size: int | None = None
    symmetric: bool = True
    zero_offset: int = 0
    activations: str | None = None
    ignore: tuple[str, ...] = field(default_factory=tuple)

    def quantizes(self, module_name: str) -> bool:
        """Whether the HF linear `module_name` (e.g. model.layers.0.mlp.down_proj) is stored
        quantized in the checkpoint."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module_name):
                    return False
            elif module_name == entry or module_name.endswith("." + entry):
                return False
        return True

    def describe(self) -> str:
        if self.kind == FP8:
            scales = f"{self.block[0]}x{self.block[1]} block" if self.block else "per-channel"
            return f"{self.layout} FP8 e4m3 weights, {scales} scales"
        groups = f"group {self.group_size}" if self.group_size else "per-channel"
        zeros = "symmetric" if self.symmetric else "zero points"
        return f"{self.layout} int4 weights, {groups} scales, {zeros}"


def _refuse(key: str, value, supported: str) -> ModelLoadError:
    return ModelLoadError(f"quantization_config.{key} = {value!r} is not supported ({supported})")


def read_quantization_scheme(hf_config) -> QuantizationScheme | None:
    """The scheme of `hf_config.quantization_config`, None when the checkpoint is not
    quantized. Raises ModelLoadError naming the key and value atom does not run."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "gptq":
        return _gptq(config)
    if method == "awq":
        return _awq(config)
    if method == "fp8":
        return _deepseek_fp8(config)
    raise _refuse("quant_method", method, "compressed-tensors, gptq, awq, fp8")


def _compressed_tensors(config: dict) -> QuantizationScheme:
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("quantization_status", status, "compressed")
    if config.get("sparsity_config"):
        raise _refuse("sparsity_config", config["sparsity_config"], "none")
    if config.get("kv_cache_scheme"):
        raise _refuse("kv_cache_scheme", config["kv_cache_scheme"], "none; see --kv-cache-dtype")
    if config.get("transform_config"):
        raise _refuse("transform_config", config["transform_config"], "none")
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("config_groups", sorted(groups), "exactly one group")
    ((group_name, group),) = groups.items()
    key = f"config_groups.{group_name}"
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise _refuse(f"{key}.targets", targets, '["Linear"]')
    if group.get("output_activations"):
        raise _refuse(f"{key}.output_activations", group["output_activations"], "none")
    fmt = group.get("format") or config.get("format")
    weights = group.get("weights") or {}
    kind, nbits = weights.get("type"), weights.get("num_bits")
    strategy = weights.get("strategy")
    if weights.get("dynamic", False):
        raise _refuse(f"{key}.weights.dynamic", weights["dynamic"], "false")
    activations = _ct_activations(group.get("input_activations"), f"{key}.input_activations")
    ignore = tuple(config.get("ignore") or ())
    if fmt == "float-quantized":
        if (kind, nbits) != ("float", 8):
            raise _refuse(f"{key}.weights", {"type": kind, "num_bits": nbits}, "float, 8 bits")
        if not weights.get("symmetric", True):
            raise _refuse(f"{key}.weights.symmetric", False, "true for FP8")
        block = None
        if strategy == "block":
            block = _block(weights.get("block_structure"), f"{key}.weights.block_structure")
        elif strategy not in ("tensor", "channel"):
            raise _refuse(f"{key}.weights.strategy", strategy, "tensor, channel, block for FP8")
        return QuantizationScheme(
            FP8, COMPRESSED_TENSORS, block=block, activations=activations, ignore=ignore
        )
    if fmt == "pack-quantized":
        if (kind, nbits) != ("int", 4):
            raise _refuse(f"{key}.weights", {"type": kind, "num_bits": nbits}, "int, 4 bits")
        if activations is not None:
            raise _refuse(f"{key}.input_activations", group["input_activations"], "none (w4a16)")
        actorder = weights.get("actorder")
        if actorder not in (None, "static", "weight"):
            raise _refuse(f"{key}.weights.actorder", actorder, "static, weight or none")
        group_size = None
        if strategy == "group":
            group_size = weights.get("group_size")
            if not isinstance(group_size, int) or group_size <= 0 or group_size % 2:
                raise _refuse(f"{key}.weights.group_size", group_size, "a positive even int")
        elif strategy != "channel":
            raise _refuse(f"{key}.weights.strategy", strategy, "group, channel for int4")
        return QuantizationScheme(
            INT4,
            COMPRESSED_TENSORS,
            group_size=group_size,
            symmetric=bool(weights.get("symmetric", True)),
            ignore=ignore,
        )
    raise _refuse("format", fmt, "float-quantized, pack-quantized")


def _ct_activations(args: dict | None, key: str) -> str | None:
    if not args:
        return None
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise _refuse(key, args, "FP8 activations or none")
    if not args.get("dynamic", False):
        return "static"
    if args.get("strategy") != "token":
        raise _refuse(f"{key}.strategy", args.get("strategy"), "token for dynamic activations")
    return "dynamic"


def _block(value, key: str) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise _refuse(key, value, "[rows, cols] of positive ints")
    return int(value[0]), int(value[1])


def _gptq(config: dict) -> QuantizationScheme:
    bits = config.get("bits")
    if bits != 4:
        raise _refuse("bits", bits, "4")
    if config.get("desc_act", False):
        raise _refuse("desc_act", config["desc_act"], "false (act-order g_idx is not run)")
    if config.get("lm_head", False):
        raise _refuse("lm_head", config["lm_head"], "false")
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "gptq, gptq_v2")
    return QuantizationScheme(
        INT4,
        GPTQ,
        group_size=_int4_group(config.get("group_size"), "group_size"),
        symmetric=False,  # zeros are always stored (8 for symmetric checkpoints)
        zero_offset=1 if fmt == "gptq" else 0,
        ignore=tuple(config.get("modules_to_not_convert") or ()),
    )


def _awq(config: dict) -> QuantizationScheme:
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise _refuse("bits", bits, "4")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", config.get("version"), "gemm")
    if not config.get("zero_point", True):
        raise _refuse("zero_point", config["zero_point"], "true")
    group = config.get("group_size", config.get("q_group_size"))
    return QuantizationScheme(
        INT4,
        AWQ,
        group_size=_int4_group(group, "group_size"),
        symmetric=False,
        ignore=tuple(config.get("modules_to_not_convert") or ()),
    )


def _int4_group(value, key: str) -> int | None:
    if value == -1:
        return None
    if not isinstance(value, int) or value <= 0 or value % 2:
        raise _refuse(key, value, "-1 (per channel) or a positive even int")
    return value


def _deepseek_fp8(config: dict) -> QuantizationScheme:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fmt", fmt, "e4m3")
    activations = config.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise _refuse("activation_scheme", activations, "dynamic, static")
    if "weight_block_size" not in config or config["weight_block_size"] is None:
        raise _refuse("weight_block_size", None, "[rows, cols]: per-tensor fp8 is not read")
    block = _block(config["weight_block_size"], "weight_block_size")
    # transformers' FineGrainedFP8Config options that change what a tensor holds
    scale_fmt = config.get("scale_fmt", "float")
    if scale_fmt != "float":
        raise _refuse("scale_fmt", scale_fmt, "float: ue8m0 (float8_e8m0fnu) scales are not read")
    expert_dtype = config.get("expert_dtype", "fp8")
    if expert_dtype != "fp8":
        raise _refuse("expert_dtype", expert_dtype, "fp8: FP4-packed experts are not read")
    if config.get("modules_to_convert"):
        raise _refuse("modules_to_convert", config["modules_to_convert"], "none (FP8 embeddings)")
    ignore = config.get("modules_to_not_convert") or config.get("ignored_layers") or ()
    return QuantizationScheme(
        FP8, DEEPSEEK_FP8, block=block, activations=activations, ignore=tuple(ignore)
    )

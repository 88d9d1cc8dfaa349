"""The DeepSeek-V4 / V4.1 checkpoint loader: tensors copied into the model by module name.

`checkpoint_targets` lists where each checkpoint tensor goes (parameters, routing buffers,
the parts of the stacked projections, and for a quantized checkpoint its FP8 layers and
experts); `load_checkpoint` copies a checkpoint's tensors into them, stacking the per-expert
linears, and names any tensor with no place, a shape that differs or a target left unset;
`hf_name` maps the DeepSeek names HF's `save_pretrained` writes for V4 to HF module names.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from atom.models.load_error import ModelLoadError, check_shape
from atom.models.parallel_layers import LayerPart, dense, part_targets
from atom.models.quantization.experts import Fp8Experts
from atom.models.quantization.fp8 import FP8_DTYPE


def checkpoint_targets(model: nn.Module) -> dict:
    """Module name -> where that checkpoint tensor loads: a parameter or buffer, the rows of
    a stacked projection (`parallel_layers.part_targets`: a view, or a LayerPart for a
    quantized layer), or at `<prefix>` an `Fp8Experts` its experts' linears load into."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers())
    part_targets(model, targets)  # the stacked projections' parts, by checkpoint name
    for name, module in model.named_modules():
        if isinstance(module, Fp8Experts):  # loaded one expert linear at a time
            for tensor in ("gate_up_proj", "down_proj", "gate_up_scale", "down_scale"):
                targets.pop(f"{name}.{tensor}")
            targets[name] = module
    return targets


def load_checkpoint(config, targets: dict, weights, name_of, expert_pattern) -> None:
    """Copy `weights` ((source name, tensor) pairs) into `targets` (module name -> tensor),
    DeepSeek V4 / V4.1 style: `name_of(source)` is the module name (None: skip the tensor);
    names matching `expert_pattern` ((prefix).N.(w1|w2|w3).weight) go into row N of the
    stacked `prefix.gate_up_proj` (w1, w3: its two halves) or `prefix.down_proj`. Raises
    ValueError for a tensor with no place, a shape that differs, or any target left unset
    (a stacked expert tensor counts per expert and part, unless it came whole).

    A quantized checkpoint's targets may also be a `LayerPart` (a quantized linear, given
    the checkpoint's Fp8Weight) or, at `prefix`, the `Fp8Experts` its FP8 experts load into;
    a quantized tensor bound for a dense target is dequantized."""
    tied = getattr(config, "tie_word_embeddings", False)
    inter = config.moe_intermediate_size
    loaded = set()
    for source, tensor in weights:
        name = name_of(source)
        if name is None or (name == "lm_head.weight" and tied):
            continue
        expert = expert_pattern.match(name)
        if expert is not None:
            prefix, index, part = expert.group(1), int(expert.group(2)), expert.group(3)
            target = f"{prefix}.down_proj" if part == "w2" else f"{prefix}.gate_up_proj"
            experts = targets.get(prefix)
            if isinstance(experts, Fp8Experts) and index < experts.gate_up_proj.shape[0]:
                hf_part = _EXPERT_PARTS[part]
                experts.load(index, hf_part, experts.expert_weight(tensor, source, hf_part))
                loaded.add(f"{target}#{index}.{part}")
                continue
            if target not in targets or index >= targets[target].shape[0]:
                raise ValueError(f"checkpoint tensor {source!r} has no place in the model")
            dest = targets[target].data[index]
            if part != "w2":
                dest = dest.narrow(0, 0 if part == "w1" else inter, inter)
            _copy(dest, tensor, source)
            loaded.add(f"{target}#{index}.{part}")
            continue
        if name not in targets:
            if isinstance(targets.get(name.rpartition(".")[0]), Fp8Experts):
                raise ModelLoadError(
                    f"checkpoint tensor {source!r}: stacked experts in a quantized checkpoint "
                    "are not read; FP8 experts are read one expert at a time (experts.<e>.w1 ...)"
                )
            raise ValueError(f"checkpoint tensor {source!r} has no place in the model")
        if isinstance(targets[name], LayerPart):
            targets[name].load(tensor, source)
        else:
            _copy(targets[name].data, tensor, source)
        loaded.add(name)
    expected = set()
    for name, target in targets.items():
        if tied and name == "lm_head.weight":
            continue
        if isinstance(target, Fp8Experts):
            expected |= {
                f"{name}.{stack}#{e}.{part}"
                for e in range(target.gate_up_proj.shape[0])
                for stack, part in (("gate_up_proj", "w1"), ("gate_up_proj", "w3"), ("down_proj", "w2"))
            }  # fmt: skip
            continue
        parts = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and name not in loaded:
            expected |= {f"{name}#{e}.{p}" for e in range(target.shape[0]) for p in parts}
        else:
            expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")


def _copy(dest: torch.Tensor, tensor, source: str) -> None:
    tensor = dense(tensor, dest.dtype)  # a quantized linear bound for a dense weight
    if tensor.dtype == FP8_DTYPE:
        raise ModelLoadError(
            f"checkpoint tensor {source!r} is {FP8_DTYPE} without a weight_scale_inv beside "
            "it (a quantized checkpoint's FP8 weights come with their block scales)"
        )
    check_shape(tensor, dest.shape, source)
    dest.copy_(tensor)


# HF transformers' V4 conversion mapping (conversion_mapping.py, "deepseek_v4"), in order.
_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "model.embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)", r"model.hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)", r".ffn_hc.\1"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
V4_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Fp8Experts' names


def hf_name(name: str) -> str:
    """The HF module name of a DeepSeek-named V4 checkpoint tensor (experts stay per expert:
    `...mlp.experts.N.w1/w2/w3.weight`, stacked by `load_weights`)."""
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name

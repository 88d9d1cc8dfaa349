"""Architecture name (HF `config.architectures[0]`) -> model class."""

from __future__ import annotations

from atom.models.deepseek_v2 import DeepseekV2ForCausalLM
from atom.models.deepseek_v4 import DeepseekV4ForCausalLM
from atom.models.deepseek_v41 import DeepseekV41ForCausalLM
from atom.models.llama import LlamaForCausalLM
from atom.models.loader import ModelLoadError
from atom.models.qwen3_next import Qwen3NextForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "DeepseekV41ForCausalLM": DeepseekV41ForCausalLM,
}

BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "deepseek_v41_text": "DeepseekV41ForCausalLM",
}


# Every family here runs SiLU (the MLPs, the fused MoE kernel, Qwen3-Next's GDN conv and
# gates), as all their released checkpoints do; HF's ACT2FN spells it both ways.
SUPPORTED_ACTIVATIONS = ("silu", "swish")


def check_activation(config) -> None:
    """Refuse a `hidden_act` the model code does not run (it would give other tokens than
    HF with no error)."""
    act = getattr(config, "hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(
            f"{getattr(config, 'model_type', None)}: config.json hidden_act {act!r} is not "
            f"supported (supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
        )


def model_class(config):
    """The model class of `config`; refuses an architecture or a `hidden_act` it lacks."""
    archs = list(getattr(config, "architectures", None) or [])
    archs += [BY_MODEL_TYPE.get(getattr(config, "model_type", None), "")]
    for arch in archs:
        if arch in MODELS:
            check_activation(config)
            return MODELS[arch]
    raise ValueError(
        f"unsupported architecture {archs[:-1] or getattr(config, 'model_type', None)!r}; supported: {', '.join(MODELS)}"
    )

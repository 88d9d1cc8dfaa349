"""Architecture name (HF `config.architectures[0]`) -> model class."""

from __future__ import annotations

from atom.models.deepseek_v2 import DeepseekV2ForCausalLM
from atom.models.deepseek_v4 import DeepseekV4ForCausalLM
from atom.models.deepseek_v41 import DeepseekV41ForCausalLM
from atom.models.llama import LlamaForCausalLM
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


def model_class(config):
    archs = list(getattr(config, "architectures", None) or [])
    archs += [BY_MODEL_TYPE.get(getattr(config, "model_type", None), "")]
    for arch in archs:
        if arch in MODELS:
            return MODELS[arch]
    raise ValueError(
        f"unsupported architecture {archs[:-1] or getattr(config, 'model_type', None)!r}; supported: {', '.join(MODELS)}"
    )

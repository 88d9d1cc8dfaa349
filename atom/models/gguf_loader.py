"""Read a llama.cpp GGUF file as a Hugging Face config plus HF-named float32 tensors.

Only the metadata is parsed up front; tensors stay memory-mapped and are dequantized one at
a time by `iter_gguf_weights`, so a model never needs two full copies in memory.
"""

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config

from atom.models.load_error import ModelLoadError

CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {"llama": LlamaConfig, "qwen2": Qwen2Config}

# llama.cpp short names -> HF names inside `model.layers.N.`
LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Llama 3.x files carry their rope scaling as this tensor instead of metadata.
ROPE_FREQS_TENSOR = "rope_freqs.weight"
LAYER_TENSOR_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFContents:
    """What `read_gguf` found: the HF config, the open reader and the chat template."""

    hf_config: PretrainedConfig
    reader: gguf.GGUFReader
    chat_template: str | None


def read_gguf(path: str) -> GGUFContents:
    """Parse the GGUF header at `path` and build the matching HF config (no tensor data read)."""
    with open(path, "rb") as file:
        magic = file.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{path} is not a GGUF file (first bytes {magic!r}, expected b'GGUF'); "
            "pass a .gguf file or a Hugging Face model directory"
        )
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader fails with numpy/struct errors on damaged files
        raise ModelLoadError(
            f"{path} is a corrupt or truncated GGUF file: {type(e).__name__}: {e}"
        ) from e
    metadata = _Metadata(path, reader)
    hf_config = _build_config(path, reader, metadata)
    return GGUFContents(hf_config, reader, metadata.get("tokenizer.chat_template"))


def iter_gguf_weights(
    path: str, reader: gguf.GGUFReader, hf_config: PretrainedConfig, wanted=None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 CPU tensor), dequantizing one tensor at a time; a name
    that `wanted` refuses is skipped before its dequantization."""
    permute_qk = hf_config.model_type == "llama"
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            continue  # folded into hf_config.rope_parameters by _llama3_rope_parameters
        name = hf_tensor_name(path, tensor.name)
        if wanted is not None and not wanted(name):
            continue
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ModelLoadError(
                f"{path}: cannot dequantize tensor {tensor.name} "
                f"({tensor.tensor_type.name}): {type(e).__name__}: {e}"
            ) from e
        hf_shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims fastest first
        if values.size != math.prod(hf_shape):
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} holds {values.size} values, expected shape {hf_shape}"
            )
        values = values.reshape(hf_shape)
        if permute_qk and ".attn_q." in tensor.name:
            values = unpermute_rotary_rows(values, hf_config.num_attention_heads)
        elif permute_qk and ".attn_k." in tensor.name:
            values = unpermute_rotary_rows(values, hf_config.num_key_value_heads)
        if not values.flags.writeable:  # F32 tensors come back as views of the read-only map
            values = values.copy()
        yield name, torch.from_numpy(values.astype(np.float32, copy=False))


def hf_tensor_name(path: str, gguf_name: str) -> str:
    """Map a llama.cpp tensor name (`blk.3.attn_q.weight`) to its HF name."""
    if match := LAYER_TENSOR_PATTERN.fullmatch(gguf_name):
        layer, short_name, kind = match.groups()
        if short_name in LAYER_TENSOR_NAMES:
            return f"model.layers.{layer}.{LAYER_TENSOR_NAMES[short_name]}.{kind}"
    else:
        short_name, _, kind = gguf_name.rpartition(".")
        if short_name in GLOBAL_TENSOR_NAMES and kind in ("weight", "bias"):
            return f"{GLOBAL_TENSOR_NAMES[short_name]}.{kind}"
    raise ModelLoadError(f"{path}: tensor {gguf_name} has no known Hugging Face name")


def unpermute_rotary_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` of attn_q / attn_k rows (weights or biases).

    convert_hf_to_gguf.py interleaves each head's two rotary halves:
    `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)`. Reading the rows back
    as (n_head, rows // n_head // 2, 2) and swapping the same axes restores HF's layout.
    """
    half_head_dim = weight.shape[0] // n_head // 2
    grouped = weight.reshape(n_head, half_head_dim, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


class _Metadata:
    """Typed access to GGUF key/values; a missing required key is a ModelLoadError."""

    def __init__(self, path: str, reader: gguf.GGUFReader):
        self.path = path
        self.fields = reader.fields

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise ModelLoadError(
                f"{self.path}: cannot read GGUF metadata {key}: {type(e).__name__}: {e}"
            ) from e

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks required key {key}")
        return value


def _build_config(path: str, reader: gguf.GGUFReader, metadata: _Metadata) -> PretrainedConfig:
    arch = metadata.require("general.architecture")
    if arch not in CONFIG_CLASSES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(CONFIG_CLASSES)})"
        )
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    for required in ("token_embd.weight", "blk.0.attn_q.weight"):
        if required not in tensors:
            raise ModelLoadError(f"{path}: GGUF file has no {required} tensor")

    n_head = int(metadata.require(f"{arch}.attention.head_count"))
    # The q rows give head_dim even when it differs from hidden_size / n_head.
    q_rows = int(tensors["blk.0.attn_q.weight"].shape[-1])
    head_dim = q_rows // n_head
    rope_dim = metadata.get(f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ModelLoadError(
            f"{path}: partial rotary embeddings (rope.dimension_count={rope_dim}, "
            f"head_dim={head_dim}) are not supported"
        )
    rope_theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    rope_parameters |= _gguf_rope_scaling(arch, metadata)
    if ROPE_FREQS_TENSOR in tensors:
        rope_parameters |= _llama3_rope_parameters(path, tensors[ROPE_FREQS_TENSOR], rope_theta)

    kwargs = dict(
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),
        hidden_size=int(metadata.require(f"{arch}.embedding_length")),
        intermediate_size=int(metadata.require(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(metadata.require(f"{arch}.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=int(metadata.get(f"{arch}.attention.head_count_kv", n_head)),
        head_dim=head_dim,
        rms_norm_eps=float(metadata.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(metadata.get(f"{arch}.context_length", 2048)),
        rope_parameters=rope_parameters,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_optional_int(metadata.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_optional_int(metadata.get("tokenizer.ggml.eos_token_id")),
        pad_token_id=_optional_int(metadata.get("tokenizer.ggml.padding_token_id")),
    )
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    return CONFIG_CLASSES[arch](**kwargs)


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def _gguf_rope_scaling(arch: str, metadata: _Metadata) -> dict:
    """Translate `{arch}.rope.scaling.*` keys (linear / yarn) into HF rope_parameters."""
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if scaling_type in (None, "none") or factor is None:
        return {}
    if scaling_type not in ("linear", "yarn"):
        raise ModelLoadError(f"{metadata.path}: rope scaling type {scaling_type!r} not supported")
    parameters = {"rope_type": scaling_type, "factor": float(factor)}
    original_context = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original_context is not None:
        parameters["original_max_position_embeddings"] = int(original_context)
    if scaling_type == "yarn":
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = metadata.get(f"{arch}.rope.scaling.{key}")
            if value is not None:
                parameters[name] = float(value)
        for key in ("attn_factor", "yarn_attn_factor", "yarn_log_multiplier", "yarn_ext_factor"):
            if metadata.get(f"{arch}.rope.scaling.{key}") is not None:
                raise ModelLoadError(
                    f"{metadata.path}: yarn rope scaling with rope.scaling.{key} is not "
                    "supported (only factor, original_context_length and the betas)"
                )
    return parameters


def _llama3_rope_parameters(path: str, rope_freqs: gguf.ReaderTensor, rope_theta: float) -> dict:
    """Recover HF's llama3 rope scaling from llama.cpp's per-frequency divisors.

    convert_hf_to_gguf.py stores 1 / scale for each rotary frequency; the factor is its maximum.
    The other llama3 knobs are not stored, so the Llama 3.x defaults are assumed and then
    checked by recomputing the divisors.
    """
    divisors = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type).astype(np.float64)
    parameters = {
        "rope_type": "llama3",
        "factor": float(divisors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    head_dim = 2 * divisors.size
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelengths = 2 * math.pi / freqs
    old_context = parameters["original_max_position_embeddings"]
    smooth = (old_context / wavelengths - 1.0) / (4.0 - 1.0)
    expected = 1 / ((1 - smooth) / parameters["factor"] + smooth)
    expected = np.where(wavelengths < old_context / 4.0, 1.0, expected)
    expected = np.where(wavelengths > old_context / 1.0, parameters["factor"], expected)
    if not np.allclose(divisors, expected, rtol=1e-4):
        raise ModelLoadError(
            f"{path}: rope_freqs.weight does not match llama3 rope scaling with the default "
            "low/high frequency factors; this rope scaling is not supported"
        )
    return parameters

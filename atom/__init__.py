"""atom: a compact LLM inference engine."""

from atom.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":  # imported lazily: it pulls in torch, transformers and the kernels
        from atom.model_engine.llm_engine import LLM

        return LLM
    raise AttributeError(name)

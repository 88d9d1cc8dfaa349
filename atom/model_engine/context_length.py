"""The context length the engine serves (`max_model_len`): the model's, the user's, the
KV cache's."""

from __future__ import annotations

import logging

from atom.config import Config

logger = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192


def resolve_max_model_len(config: Config, hf_config) -> int:
    """The context length the engine serves: the user's, capped by the model's."""
    model_len = int(getattr(hf_config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN))
    if config.max_model_len is not None and config.max_model_len > model_len:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's context length {model_len}"
        )
    return config.max_model_len or min(model_len, DEFAULT_MAX_MODEL_LEN)


def fit_max_model_len(config: Config, max_model_len: int, num_blocks: int) -> int:
    """`max_model_len`, checked against the KV cache: one request of that length must fit.

    A request longer than the cache would preempt itself forever. A max_model_len the
    user asked for is refused; the model's own (the default) is lowered to the cache.
    """
    capacity = num_blocks * config.block_size
    if max_model_len <= capacity:
        return max_model_len
    if config.max_model_len is not None:
        raise ValueError(
            f"max_model_len {max_model_len} does not fit the KV cache: it holds {num_blocks} "
            f"blocks of {config.block_size} tokens ({capacity} tokens); lower --max-model-len "
            f"to at most {capacity}, or give the cache more memory (--gpu-memory-utilization "
            "on CUDA, --kv-cache-memory-gb on CPU)"
        )
    logger.warning(
        "the KV cache holds %d tokens (%d blocks), fewer than the model's context of %d: "
        "serving max_model_len %d (give the cache more memory for longer requests)",
        capacity,
        num_blocks,
        max_model_len,
        capacity,
    )
    return capacity

"""A tiny Llama shape and weights under which greedy decoding is predictable (token x is
followed by perm(x)): speculative decoding's tests and its benchmark share them."""

from __future__ import annotations

import torch

TINY = dict(
    vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
)  # fmt: skip


@torch.no_grad()
def set_margin_weights(model, seed: int = 1234, scale: float = 16.0) -> torch.Tensor:
    """Embeddings N(0, scale^2); LM head row perm(x) = embedding row x / scale.

    The residual stream of token x is scale * E[x] plus the layers' output (RMS ~ a few
    units), so the final norm's output points along E[x] and perm(x) wins by a margin of
    ~hidden_size against ~4.5 * sqrt(hidden_size) for the best other row. The same seed
    gives every model of one vocabulary and hidden size the same tables (target, draft).
    Returns perm.
    """
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    if embed.data_ptr() == head.data_ptr():
        raise ValueError("margin weights need an untied LM head (tie_word_embeddings=False)")
    generator = torch.Generator(device=embed.device).manual_seed(seed)
    table = torch.randn(embed.shape, generator=generator, device=embed.device)
    perm = torch.randperm(embed.shape[0], generator=generator, device=embed.device)
    embed.copy_(table * scale)
    head[perm] = table.to(head.dtype)
    return perm

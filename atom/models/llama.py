"""Llama-family decoder (Llama 2/3, SmolLM, Qwen2 with qkv bias, Mistral without sliding window).

Weights use HF names; q/k/v and gate/up are fused into one matmul each and split on
load (`load_weights`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from atom.attention.mha import MHAAttention
from atom.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul, rope_parameters


class LlamaAttention(nn.Module):
    def __init__(self, config, max_position: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        theta, scaling = rope_parameters(config)
        self.rotary = RotaryEmbedding(self.head_dim, max_position, theta, scaling)
        self.attn = MHAAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, max_position: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, max_position)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, max_position: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, max_position) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # HF name fragment -> (fused parameter fragment, shard id)
    stacked_params = (
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    )

    def __init__(self, config, max_position: int | None = None):
        super().__init__()
        self.config = config
        max_position = max_position or config.max_position_embeddings
        self.model = LlamaModel(config, max_position)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def attention_layers(self) -> list[MHAAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter must be set."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        attn0 = self.model.layers[0].self_attn
        q_size, kv_size = attn0.q_size, attn0.kv_size
        inter = self.config.intermediate_size
        offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        offsets.update({0: (0, inter), 1: (inter, inter)})
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for hf_part, fused_part, shard in self.stacked_params:
                if f".{hf_part}." in name:
                    target = name.replace(hf_part, fused_part)
                    start, size = offsets[shard]
                    _copy_into(params, target, tensor, start, size, name)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                _copy_into(params, name, tensor, None, None, name)
                loaded.add(name)
        expected = set()
        for pname in params:
            if "qkv_proj" in pname:
                expected |= {f"{pname}#{s}" for s in "qkv"}
            elif "gate_up_proj" in pname:
                expected |= {f"{pname}#0", f"{pname}#1"}
            elif not (pname == "lm_head.weight" and self.tie_word_embeddings):
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")


def _copy_into(params, target, tensor, start, size, source_name):
    param = params.get(target)
    if param is None:
        raise ValueError(f"checkpoint tensor {source_name!r} has no place in the model")
    dest = param.data if start is None else param.data.narrow(0, start, size)
    if dest.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {source_name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(dest.shape)}"
        )
    dest.copy_(tensor)

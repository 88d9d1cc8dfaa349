"""Building blocks shared by the model files: norms, rotary embedding, activations.

Numerics follow HF transformers (normalisation in fp32, cast back before the weight)
so that greedy outputs match it token for token in fp32.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from atom.forward_context import current_forward_context
from atom.kernels import (
    apply_rotary,
    apply_rotary_reference,
    rms_norm,
    silu_and_mul,
    silu_and_mul_reference,
)
from atom.kernels.rmsnorm import rms_norm_cpu
from atom.kernels.rotary import rotary_rows, rotate_rows


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise x; with `residual`, first add it and also return the sum."""
        if x.is_cuda:
            return rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_cpu(x, self.weight, self.eps, residual)


class PreNormDecoderLayer(nn.Module):
    """The residual pattern every decoder layer here shares: RMSNorm -> attention -> fused
    add + RMSNorm -> MLP, with the residual stream carried to the next layer's norm.

    Subclasses set `self_attn(positions, hidden)`, `mlp(hidden)`, `input_layernorm` and
    `post_attention_layernorm`."""

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MissingLayer(nn.Module):
    """The place of a decoder layer that another pipeline stage holds (no parameters), so
    layer indices, and with them checkpoint names, stay those of the whole model."""

    def forward(self, *args):
        raise RuntimeError("this decoder layer lives on another pipeline stage")


def stage_layers(num_layers: int, make_layer, layer_range: tuple[int, int] | None = None):
    """ModuleList of `num_layers` entries: `make_layer(i)` inside `layer_range` (all of
    them without one), a MissingLayer elsewhere."""
    start, end = layer_range or (0, num_layers)
    return nn.ModuleList(
        make_layer(i) if start <= i < end else MissingLayer() for i in range(num_layers)
    )


class DecoderStack(nn.Module):
    """embed_tokens -> PreNormDecoderLayers -> final RMSNorm (subclasses build the three).

    Under pipeline parallelism a stage holds a contiguous range of the layers (the others
    are MissingLayers). A stage other than the first takes `intermediate` = (hidden,
    residual) from the previous stage instead of embedding `input_ids` (it has no
    embedding); a stage other than the last has no norm and returns (hidden, residual).
    """

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        for layer in self.layers:
            if not isinstance(layer, MissingLayer):
                hidden, residual = layer(positions, hidden, residual)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class SiluAndMul(nn.Module):
    """[..., 2 * I] (gate | up) -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x) if x.is_cuda else silu_and_mul_reference(x)


def rope_parameters(config) -> tuple[float, dict | None]:
    """(theta, scaling) from an HF config of transformers 4.x or 5.x."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = params if params.get("rope_type", "default") != "default" else None
        return theta, scaling
    theta = float(getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, params: dict, max_position_embeddings: int):
    """HF's `_compute_yarn_parameters`: (inv_freq, attention_factor)."""
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (
        1.0 / pos_freqs
    ) * extrapolation_factor
    return inv_freq, float(attention_factor)


ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (HF `rotate_half`) with a precomputed cos/sin cache.

    Scalings as HF computes them: linear (frequencies / factor), llama3, yarn (frequency
    blend plus an attention factor on cos/sin). `model_max_position` is the config's
    max_position_embeddings (yarn's default original context and factor derive from it).
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict | None,
        model_max_position: int | None = None,
    ):
        super().__init__()
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        attention_factor = 1.0
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "linear":
                inv_freq = inv_freq / float(scaling["factor"])
            elif kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            elif kind == "yarn":
                inv_freq, attention_factor = yarn_inv_freq(
                    head_dim, theta, scaling, model_max_position or max_position
                )
            else:
                raise ValueError(
                    f"unsupported rope scaling {kind!r} (supported: {', '.join(ROPE_SCALINGS)})"
                )
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D] -> rotated copies."""
        if q.is_cuda:
            return apply_rotary(positions, q, k, self.cos, self.sin)
        return apply_rotary_reference(positions, q, k, self.cos, self.sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated on CPU (q and k heads side by side: one pass for both), the
        same bytes as `forward`; the cos / sin rows of `positions` are computed once per
        forward and shared by every layer holding this embedding (ForwardContext)."""
        context = current_forward_context()
        key = (self.cos.data_ptr(), positions.data_ptr(), x.dtype)
        rows = None if context is None else context.cpu_rotary_rows.get(key)
        if rows is None:
            rows = rotary_rows(positions, self.cos, self.sin, x.dtype)
            if context is not None:
                context.cpu_rotary_rows[key] = rows
        return rotate_rows(x, *rows)

"""DeepSeek-V2 / V3 decoder: multi-head latent attention (MLA) and DeepSeekMoE.

Follows HF transformers' DeepseekV2 / DeepseekV3 modeling (what the parity tests compare
against):
- attention: optional q LoRA (q_lora_rank None -> q_proj), compressed KV
  (kv_a_proj_with_mqa -> normalised c | k_pe), kv_b_proj decompresses; the cache holds
  (c | rotated k_pe) per token (atom/attention/mla.py, backend "mla");
- rope on the rope part only, DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... (V2, and
  V3 with rope_interleave) or rotate-half (V3 without); YaRN scales cos/sin by its
  attention factor and the softmax scale by mscale(factor, mscale_all_dim)^2;
- MoE from layer `first_k_dense_replace` on (every `moe_layer_freq`-th layer, 1 in HF), with
  shared experts; routing V2: softmax, `greedy` or `group_limited_greedy` (HF V2 ignores
  norm_topk_prob, so do we); V3 (`noaux_tc`): sigmoid + e_score_correction_bias for the
  choice, top-2-sum group limit, optional normalisation; both times routed_scaling_factor.

The rotated rope output is laid out de-interleaved (evens then odds, as HF V3): q and k
get the same permutation, so every dot product equals HF V2's interleaved layout.
Experts are stacked per layer ([E, 2I, H] and [E, H, I]); checkpoints store them one
expert at a time (HF `save_pretrained`) or stacked, both load. The routed experts run through
atom/models/moe.py (sorted by expert, no host sync on CUDA, the same path under graphs).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from atom.attention.family import MLAFamily
from atom.attention.mla import MLAAttention
from atom.distributed.tensor_parallel import ShardingError
from atom.kernels.platform import use_cuda_path
from atom.models.layers import DecoderStack, PreNormDecoderLayer, RMSNorm, yarn_mscale
from atom.models.layers import yarn_inv_freq as _yarn_inv_freq
from atom.models.load_error import ModelLoadError, check_shape
from atom.models.moe import routed_experts
from atom.models.parallel_layers import checkpoint_linear, dense, load_parameter
from atom.models.quantization import FP8, read_quantization_scheme
from atom.models.quantization.experts import Fp8Experts
from atom.models.quantization.fp8 import quant_kernels_enabled


def _linear(config, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
    """nn.Linear, or for a quantized checkpoint that quantizes the HF linear `name` (e.g.
    model.layers.0.self_attn.q_proj) a one-part ColumnParallelLinear holding FP8 / int4
    weights. kv_b_proj (read whole by MLA) is dequantized at load; routed experts:
    DeepseekMoE."""
    scheme = read_quantization_scheme(config)
    return checkpoint_linear(scheme, name, in_features, out_features, bias)


def _rope_params(config) -> tuple[float, dict]:
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        params = dict(getattr(config, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    return theta, {**params, "rope_type": kind}


class DeepseekRotaryEmbedding(nn.Module):
    """Rope over the last dim of q_pe [T, H, R] / k_pe [T, 1, R], computed in fp32."""

    def __init__(self, config, max_position: int):
        super().__init__()
        dim = config.qk_rope_head_dim
        theta, params = _rope_params(config)
        kind = params["rope_type"]
        if kind == "default":
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            attention_factor = 1.0
        elif kind == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(
                dim, theta, params, config.max_position_embeddings
            )
        else:
            raise ValueError(f"unsupported rope scaling {kind!r} for DeepSeek (none, yarn)")
        self.interleaved = config.model_type == "deepseek_v2" or bool(
            getattr(config, "rope_interleave", True)
        )
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        y = x.float()
        if self.interleaved:
            x1, x2 = y[..., 0::2], y[..., 1::2]
        else:
            x1, x2 = y.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def softmax_scale(config) -> float:
    """HF `yarn_apply_mscale`: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, params = _rope_params(config)
    if params["rope_type"] != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            mscale = yarn_mscale(params["factor"], mscale_all_dim)
            scale = scale * mscale * mscale
    return scale


class DeepseekV2Attention(nn.Module):
    def __init__(self, config, max_position: int, prefix: str = "self_attn"):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.v_head_dim = config.v_head_dim
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        q_out = self.num_heads * self.qk_head_dim
        if self.q_lora_rank is None:
            self.q_proj = _linear(config, f"{prefix}.q_proj", hidden, q_out, bias=False)
        else:
            self.q_a_proj = _linear(config, f"{prefix}.q_a_proj", hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = _linear(config, f"{prefix}.q_b_proj", self.q_lora_rank, q_out, False)
        self.kv_a_proj_with_mqa = _linear(
            config, f"{prefix}.kv_a_proj_with_mqa", hidden, self.kv_lora_rank + self.rope_dim, bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_head_dim), bias=False
        )
        self.o_proj = _linear(
            config, f"{prefix}.o_proj", self.num_heads * self.v_head_dim, hidden, bias
        )
        self.rotary = DeepseekRotaryEmbedding(config, max_position)
        self.attn = MLAAttention(
            self.num_heads,
            self.kv_lora_rank,
            self.nope_dim,
            self.rope_dim,
            self.v_head_dim,
            softmax_scale(config),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(-1, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        compressed = self.kv_a_proj_with_mqa(hidden)
        kv_c, k_pe = compressed.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        q_pe = self.rotary(positions, q_pe)
        k_pe = self.rotary(positions, k_pe[:, None, :])[:, 0]
        latent = torch.cat((kv_c, k_pe), dim=-1)
        return self.o_proj(self.attn(q_nope, q_pe, latent, self.kv_b_proj.weight))


class DeepseekMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, config=None, prefix: str = "mlp"):
        """prefix: the HF module name (model.layers.<i>.mlp), for a quantized checkpoint."""
        super().__init__()
        hidden, inter = hidden_size, intermediate_size
        self.gate_proj = _linear(config, f"{prefix}.gate_proj", hidden, inter, bias=False)
        self.up_proj = _linear(config, f"{prefix}.up_proj", hidden, inter, bias=False)
        self.down_proj = _linear(config, f"{prefix}.down_proj", inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekRouter(nn.Module):
    """Top-k expert choice; weights in fp32 (HF keeps the gate in fp32)."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.num_group = getattr(config, "n_group", None)
        self.topk_group = getattr(config, "topk_group", None)
        self.routed_scaling_factor = config.routed_scaling_factor
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", False))
        method = getattr(config, "topk_method", None)
        if config.model_type == "deepseek_v3" or method == "noaux_tc":
            method = "noaux_tc"
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported topk_method {method!r}")
        self.method = method
        self.weight = nn.Parameter(
            torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32)
        )
        if method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(self.num_experts, dtype=torch.float32)
            )

    def _group_mask(self, choice_scores: torch.Tensor, group_scores: torch.Tensor):
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        per_group = self.num_experts // self.num_group
        return (
            group_mask.unsqueeze(-1)
            .expand(-1, self.num_group, per_group)
            .reshape(-1, self.num_experts)
            .bool()
        )

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (weights [T, k] fp32, expert ids [T, k])."""
        logits = F.linear(hidden.float(), self.weight.float())
        if self.method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            groups = choice.view(-1, self.num_group, self.num_experts // self.num_group)
            mask = self._group_mask(choice, groups.topk(2, dim=-1)[0].sum(dim=-1))
            choice = choice.masked_fill(~mask, float("-inf"))
            ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if self.method == "group_limited_greedy":
                groups = scores.view(-1, self.num_group, self.num_experts // self.num_group)
                mask = self._group_mask(scores, groups.max(dim=-1).values)
                scores = scores.masked_fill(~mask, 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return weights * self.routed_scaling_factor, ids


class DeepseekMoE(nn.Module):
    def __init__(self, config, prefix: str = "mlp"):
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.num_experts = config.n_routed_experts
        self.intermediate = inter
        self.gate = DeepseekRouter(config)
        scheme = read_quantization_scheme(config)
        if (
            scheme is not None
            and scheme.kind == FP8
            and scheme.quantizes(f"{prefix}.experts.0.gate_proj")
        ):
            # held in FP8; int4 experts are dequantized at load into the dense stack below
            self.experts = Fp8Experts(self.num_experts, hidden, inter, scheme)
        else:
            self.experts = nn.Module()
            self.experts.gate_up_proj = nn.Parameter(
                torch.empty(self.num_experts, 2 * inter, hidden)
            )
            self.experts.down_proj = nn.Parameter(torch.empty(self.num_experts, hidden, inter))
        shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = (
            DeepseekMLP(hidden, inter * shared, config, f"{prefix}.shared_experts")
            if shared
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        experts = self.experts
        gate_up, down, fp8_scales = experts.gate_up_proj, experts.down_proj, None
        if isinstance(experts, Fp8Experts):
            if use_cuda_path(x) and quant_kernels_enabled():
                fp8_scales = experts.fp8_scales()  # the kernels read the FP8 weights
            else:  # the reference (CPU), or ATOM_QUANT_KERNELS=0's A/B runs on CUDA
                gate_up, down, ids = experts.dense(ids, x.dtype)
        # one path for eager and CUDA-graph capture: work ~ tokens * top_k, no host sync;
        # routed + shared: on CUDA in the launch that sums the routed experts over k
        shared = None if self.shared_experts is None else self.shared_experts(x)
        return routed_experts(x, weights, ids, gate_up, down, shared=shared, fp8_scales=fp8_scales)


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_idx: int, max_position: int):
        super().__init__()
        prefix = f"model.layers.{layer_idx}"  # HF module names, for a quantized checkpoint
        self.self_attn = DeepseekV2Attention(config, max_position, f"{prefix}.self_attn")
        freq = getattr(config, "moe_layer_freq", 1) or 1
        is_moe = (
            config.n_routed_experts
            and layer_idx >= config.first_k_dense_replace
            and layer_idx % freq == 0
        )
        self.mlp = (
            DeepseekMoE(config, f"{prefix}.mlp")
            if is_moe
            else DeepseekMLP(config.hidden_size, config.intermediate_size, config, f"{prefix}.mlp")
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV2Model(DecoderStack):
    def __init__(self, config, max_position: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(config, i, max_position) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class DeepseekV2ForCausalLM(nn.Module):
    @classmethod
    def family(cls, config) -> MLAFamily:
        """The attention family the engine asks (a latent cache: its slots get MLABackends)."""
        return MLAFamily()

    def __init__(self, config, max_position: int | None = None, tp=None):
        super().__init__()
        self.validate_tensor_parallel(config, 1 if tp is None else tp.world_size)
        self.config = config
        max_position = max_position or config.max_position_embeddings
        self.model = DeepseekV2Model(config, max_position)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def validate_tensor_parallel(config, world_size: int) -> None:
        if world_size > 1:
            raise ShardingError(
                f"{config.model_type}: tensor parallelism is not supported for MLA/MoE models "
                "yet; run with --tensor-parallel-size 1"
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def attention_layers(self) -> list[MLAAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (per-expert tensors into the stacked experts); every
        parameter must be set, except V3's e_score_correction_bias (zeros by default)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        inter = self.config.moe_intermediate_size
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            match = _EXPERT.match(name)
            if match is None:
                _copy_into(params, name, tensor, name)
                loaded.add(name)
                continue
            prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
            target = f"{prefix}.down_proj" if part == "down_proj" else f"{prefix}.gate_up_proj"
            param = params.get(target)
            if param is None or expert >= param.shape[0]:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            experts = self.get_submodule(prefix)
            if isinstance(experts, Fp8Experts):
                experts.load(expert, part, experts.expert_weight(tensor, name, part))
                loaded.add(f"{target}#{expert}.{part}")
                continue
            dest = param.data[expert]
            if part != "down_proj":
                dest = dest.narrow(0, 0 if part == "gate_proj" else inter, inter)
            tensor = dense(tensor, dest.dtype)  # quantized experts are dequantized at load
            check_shape(tensor, dest.shape, name)
            dest.copy_(tensor)
            loaded.add(f"{target}#{expert}.{part}")
        expected = set()
        for pname, param in params.items():
            if pname.endswith("experts.gate_up_proj") and pname not in loaded:
                parts = ("gate_proj", "up_proj")
                expected |= {f"{pname}#{e}.{p}" for e in range(param.shape[0]) for p in parts}
            elif pname.endswith("experts.down_proj") and pname not in loaded:
                expected |= {f"{pname}#{e}.down_proj" for e in range(param.shape[0])}
            elif pname.endswith("e_score_correction_bias"):
                continue
            elif not (pname == "lm_head.weight" and self.tie_word_embeddings):
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")


def _copy_into(params, target, tensor, source_name):
    param = params.get(target)
    if param is None:
        raise ValueError(f"checkpoint tensor {source_name!r} has no place in the model")
    if hasattr(param, "weight_loader"):  # a quantized linear's weight
        load_parameter(param, tensor, None, source_name)
        return
    if param.dtype == torch.float8_e4m3fn:  # Fp8Experts, which read one expert at a time
        raise ModelLoadError(
            f"checkpoint tensor {source_name!r}: stacked experts in a quantized checkpoint are "
            "not read; FP8 experts are read one expert at a time (experts.<e>.gate_proj ...)"
        )
    tensor = dense(tensor, param.dtype)  # e.g. kv_b_proj, which MLA reads whole
    check_shape(tensor, param.shape, source_name)
    param.data.copy_(tensor)

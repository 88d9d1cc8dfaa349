"""Qwen3-Next (HF transformers' `Qwen3NextForCausalLM`, same config keys and weight names, so
a `save_pretrained` directory loads; per-expert checkpoint names load too).

- hybrid stack: `layer_types[i]` is "linear_attention" (a GDN layer, per-sequence state in a
  state slot) or "full_attention" (gated attention on the shared page table, like MHA);
  the cache and the state are the gdn backend's (atom/attention/gdn.py); a stack with no
  linear layer runs on the mha backend (no state).
- gated attention: q_proj yields per head the query and an output gate (sigmoid); q/k
  RMSNorm over the head dim; partial neox rope (`partial_rotary_factor`).
- GDN: in_proj_qkvz / in_proj_ba (loaded into one weight, `in_proj`: one GEMV at batch 1) in
  HF's per-k-head grouped order, causal depthwise conv (SiLU) over the mixed q|k|v, gated
  delta rule with g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), gated
  RMSNorm (silu(z)) on the output.
- MoE: softmax top-k router (renormalised with `norm_topk_prob`), experts through
  atom/models/moe.py `routed_experts`, a shared expert scaled by sigmoid(shared_expert_gate).
- Qwen3-Next's RMSNorm multiplies the fp32 normalisation by (1 + weight) in fp32 and
  rounds once (`OffsetRMSNorm`, HF's numerics in bf16 too: storing 1 + w in a bf16 weight
  or rounding before the multiply, Llama's order, would not be); the gated norm is HF's
  Qwen3NextRMSNormGated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from atom.attention.family import AttentionFamily, FamilySupport
from atom.attention.gdn import GatedDeltaNetState, GDNFamily
from atom.attention.mha import MHAAttention
from atom.distributed.tensor_parallel import ShardingError
from atom.forward_context import current_fusions
from atom.kernels.activation import clamped_silu_and_mul, sigmoid_gate
from atom.kernels.gdn_gates import gated_rms_norm, gdn_split
from atom.kernels.gemv import gemv_silu_and_mul
from atom.kernels.gemv_policy import use_gemv
from atom.kernels.moe_routing import softmax_route
from atom.kernels.platform import use_cuda_path
from atom.kernels.rmsnorm import rms_norm, rms_norm_reference
from atom.kernels.rotary import apply_rotary
from atom.models.layers import RMSNorm, rope_parameters
from atom.models.load_error import ModelLoadError, check_shape
from atom.models.moe import SharedExpert, routed_experts
from atom.models.parallel_layers import linear


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """`layer(x)` through parallel_layers.linear: at one row on CUDA the batch-1 GEMV
    policy's Triton GEMV where its trial measured it faster."""
    return linear(x, layer.weight, layer.bias)


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MLP_HALF = re.compile(r"(.*\.(?:mlp|shared_expert))\.(gate_proj|up_proj)\.weight$")
_IN_PROJ = re.compile(r"(.*\.linear_attn)\.(in_proj_qkvz|in_proj_ba)\.weight$")


class OffsetRMSNorm(RMSNorm):
    """HF Qwen3NextRMSNorm: (normalise(x) in fp32 * (1 + weight) in fp32).to(x.dtype); the
    checkpoint weight w as is (zeros: the identity)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        norm = rms_norm if x.is_cuda else rms_norm_reference
        return norm(x, self.weight, self.eps, residual, offset=True)


class PartialRotary(nn.Module):
    """Neox rope (HF `rotate_half`) on the first `rotary_dim` channels of each head."""

    def __init__(self, config, head_dim: int, max_position: int):
        super().__init__()
        theta, scaling = rope_parameters(config)
        if scaling is not None:
            raise ValueError("Qwen3-Next: only the default rope is supported")
        params = getattr(config, "rope_parameters", None) or {}
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        dim = int(head_dim * factor)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rotary_dim = dim
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def rotate_in_place(self, positions, q, k) -> tuple[torch.Tensor, torch.Tensor]:
        """The CUDA path: q [T, Hq, D] and k [T, Hk, D] (tensors the caller owns) rotated in
        place in one launch (atom/kernels/rotary.py, fp32 math rounded once)."""
        rotary_q, rotary_k = q[..., : self.rotary_dim], k[..., : self.rotary_dim]
        apply_rotary(positions, rotary_q, rotary_k, self.cos, self.sin, out=(rotary_q, rotary_k))
        return q, k

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> rotated copy."""
        cos = self.cos[positions].to(x.dtype)[:, None]
        sin = self.sin[positions].to(x.dtype)[:, None]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


class Qwen3NextAttention(nn.Module):
    def __init__(self, config, max_position: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = PartialRotary(config, self.head_dim, max_position)
        self.attn = MHAAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        count = hidden.shape[0]
        q, gate = _linear(hidden, self.q_proj).view(count, -1, 2 * self.head_dim).chunk(2, dim=-1)
        if use_cuda_path(hidden):
            # the norms read q and k in place and write new tensors, rotated in place
            k = _linear(hidden, self.k_proj).view(count, -1, self.head_dim)
            q, k = self.rotary.rotate_in_place(positions, self.q_norm(q), self.k_norm(k))
            v = _linear(hidden, self.v_proj).view(count, -1, self.head_dim)
            return _linear(sigmoid_gate(self.attn(q, k, v), gate), self.o_proj)
        q = self.rotary(positions, self.q_norm(q.contiguous()))
        k = self.k_norm(_linear(hidden, self.k_proj).view(count, -1, self.head_dim))
        k = self.rotary(positions, k)
        v = _linear(hidden, self.v_proj).view(count, -1, self.head_dim)
        out = self.attn(q, k, v) * torch.sigmoid(gate.reshape(count, -1))
        return _linear(out, self.o_proj)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * silu(gate), normalised in fp32 (HF Qwen3NextRMSNormGated)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class Qwen3NextGatedDeltaNet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_k_heads, self.num_v_heads = (
            config.linear_num_key_heads,
            config.linear_num_value_heads,
        )
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError("Qwen3-Next: linear_num_value_heads must be a multiple of key heads")
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        kernel = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        self.conv1d = nn.Conv1d(
            2 * key_dim + value_dim, 2 * key_dim + value_dim, kernel, bias=False,
            groups=2 * key_dim + value_dim, padding=kernel - 1,
        )  # fmt: skip
        # HF's in_proj_qkvz and in_proj_ba as one weight (their rows in that order): one
        # GEMV at batch 1 where HF runs two; `in_proj_rows` splits the output
        self.in_proj_rows = (2 * key_dim + 2 * value_dim, 2 * self.num_v_heads)
        self.in_proj = nn.Parameter(torch.empty(sum(self.in_proj_rows), hidden))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, hidden, bias=False)
        self.attn = GatedDeltaNetState(
            self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, kernel
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if use_cuda_path(hidden):
            return self._forward_fused(hidden)
        count, ratio = hidden.shape[0], self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        qkvz_weight, ba_weight = self.in_proj.split(self.in_proj_rows)
        qkvz = linear(hidden, qkvz_weight).view(count, self.num_k_heads, -1)
        q, k, v, z = qkvz.split([dk, dk, ratio * dv, ratio * dv], dim=-1)
        b, a = linear(hidden, ba_weight).view(count, self.num_k_heads, -1).split([ratio, ratio], -1)
        mixed = torch.cat([q.reshape(count, -1), k.reshape(count, -1), v.reshape(count, -1)], -1)
        beta = b.reshape(count, -1).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(count, -1).float() + self.dt_bias)
        out = self.attn(mixed, self.conv1d.weight[:, 0], g, beta)  # [T, Hv, Dv]
        out = self.norm(out.reshape(-1, dv), z.reshape(-1, dv)).reshape(count, -1)
        return _linear(out, self.out_proj)

    def _forward_fused(self, hidden: torch.Tensor) -> torch.Tensor:
        """The same math with the elementwise work in two launches (atom/kernels/gdn_gates.py):
        the split into the conv's input, g and beta; the gated norm reading z in place."""
        count, ratio = hidden.shape[0], self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        qkvz, ba = linear(hidden, self.in_proj).split(self.in_proj_rows, -1)
        mixed, g, beta = gdn_split(
            qkvz, ba, self.A_log, self.dt_bias, self.num_k_heads, dk, dv
        )  # fmt: skip
        out = self.attn(mixed, self.conv1d.weight[:, 0], g, beta)  # [T, Hv, Dv]
        z = qkvz.view(count, self.num_k_heads, -1)[..., 2 * dk + ratio * dv :]
        z = z.unflatten(-1, (ratio, dv))
        out = gated_rms_norm(out, z, self.norm.weight, self.norm.eps)
        return _linear(out, self.out_proj)


class Qwen3NextMLP(nn.Module):
    """SwiGLU MLP (the dense one and the MoE's shared expert). HF's gate_proj and up_proj
    load into one weight, ``gate_up_proj`` [2I, H] (gate rows, then up rows), so that on a
    GPU one GEMM serves both, and at one row the batch-1 GEMV policy may run both and
    SiLU * up in one launch (atom/kernels/gemv.py ``gemv_silu_and_mul``). Elsewhere
    (the CPU, the interpreter) the two halves are multiplied apart, as HF does."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(2 * inter, hidden))
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.gate_up_proj
        if x.is_cuda:
            if current_fusions().gemv_silu and use_gemv(x, weight, True):
                return _linear(gemv_silu_and_mul(x, weight), self.down_proj)
            gate, up = linear(x, weight).chunk(2, dim=-1)
            return _linear(clamped_silu_and_mul(gate, up, None), self.down_proj)
        inter = weight.shape[0] // 2
        gate, up = linear(x, weight[:inter]), linear(x, weight[inter:])
        if use_cuda_path(x):  # F.silu(gate) * up in one launch
            return _linear(clamped_silu_and_mul(gate, up, None), self.down_proj)
        return _linear(F.silu(gate) * up, self.down_proj)


class Qwen3NextSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        experts, hidden, inter = (
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
        )
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.experts.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        self.shared_expert = Qwen3NextMLP(hidden, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        # routed + sigmoid(shared_expert_gate(x)) * shared: on CUDA in the launch that sums
        # the routed experts over k, and at decode the shared expert one more pair of their
        # GEMVs (a routed expert's math: SwiGLU, no clamp)
        mlp = self.shared_expert
        inter = mlp.gate_up_proj.shape[0] // 2
        halves = (mlp.gate_up_proj[:inter], mlp.gate_up_proj[inter:], mlp.down_proj.weight)
        return routed_experts(
            x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj,
            shared_gate=self.shared_expert_gate.weight, shared_expert=SharedExpert(mlp, halves),
        )  # fmt: skip

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]). The CUDA path in one launch
        after the gate's GEMM (atom/kernels/moe_routing.py `softmax_route`: ties to the lower
        expert); the CPU path HF's ops (its `topk` orders ties as the implementation does)."""
        logits = linear(x, self.gate.weight)
        if use_cuda_path(x):
            return softmax_route(logits, self.top_k, self.norm_topk_prob)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, max_position: int):
        super().__init__()
        self.is_linear = config.layer_types[layer_idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = Qwen3NextGatedDeltaNet(config)
        else:
            self.self_attn = Qwen3NextAttention(config, max_position)
        sparse = config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0
        if sparse and layer_idx not in (config.mlp_only_layers or []):
            self.mlp = Qwen3NextSparseMoeBlock(config)
        else:
            self.mlp = Qwen3NextMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        hidden = mixer(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3NextModel(nn.Module):
    def __init__(self, config, max_position: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(config, i, max_position) for i in range(config.num_hidden_layers)
        )
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3NextForCausalLM(nn.Module):
    @classmethod
    def family(cls, config) -> AttentionFamily:
        """GDN (full-attention layers paged, GDN layers in state slots); a stack with no GDN
        layer holds no state: plain MHA as HF runs it, in one process like the others."""
        if "linear_attention" in config.layer_types[: config.num_hidden_layers]:
            return GDNFamily()
        return AttentionFamily(FamilySupport(fp8_kv=True))

    def __init__(self, config, max_position: int | None = None, tp=None):
        super().__init__()
        self.validate_tensor_parallel(config, 1 if tp is None else tp.world_size)
        self.config = config
        # Full-attention layers are paged like MHA, GDN layers keep state slots (the gdn
        # backend); a stack with no GDN layer holds no state: plain MHA, as HF runs it.
        layer_types = config.layer_types[: config.num_hidden_layers]
        if "full_attention" not in layer_types:  # the KV cache is sized by attention layers
            raise ModelLoadError(
                f"qwen3_next: layer_types {layer_types} has no full_attention layer; a "
                "stack of linear_attention layers only is not supported"
            )
        max_position = max_position or config.max_position_embeddings
        self.model = Qwen3NextModel(config, max_position)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def validate_tensor_parallel(config, world_size: int) -> None:
        if world_size > 1:
            raise ShardingError(
                f"{config.model_type}: tensor parallelism is not supported for Qwen3-Next yet; "
                "run with --tensor-parallel-size 1"
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _linear(hidden, self.lm_head)

    @property
    def attention_layers(self) -> list[MHAAttention]:
        """The full-attention layers: their K/V live in the shared paged cache."""
        return [layer.self_attn.attn for layer in self.model.layers if not layer.is_linear]

    @property
    def state_layers(self) -> list[GatedDeltaNetState]:
        """The GDN layers: their state lives in per-sequence state slots."""
        return [layer.linear_attn.attn for layer in self.model.layers if layer.is_linear]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (per-expert tensors into the stacked experts); every
        parameter must be set."""
        params = dict(self.named_parameters(remove_duplicate=False))
        inter = self.config.moe_intermediate_size
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or name.startswith("mtp."):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            in_proj = _IN_PROJ.match(name)
            if in_proj is not None:  # a GDN projection: its rows of in_proj
                target, part = f"{in_proj.group(1)}.in_proj", in_proj.group(2)
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                rows = self.get_submodule(in_proj.group(1)).in_proj_rows[0]
                dest = param.data[:rows] if part == "in_proj_qkvz" else param.data[rows:]
                _copy(dest, tensor, name)
                loaded.add(f"{target}#{part}")
                continue
            match = _EXPERT.match(name)
            half = None if match is not None else _MLP_HALF.match(name)
            if half is not None:  # a dense MLP's gate / up: its half of gate_up_proj
                target, part = f"{half.group(1)}.gate_up_proj", half.group(2)
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                rows = param.shape[0] // 2
                _copy(param.data.narrow(0, 0 if part == "gate_proj" else rows, rows), tensor, name)
                loaded.add(f"{target}#{part}")
                continue
            if match is None:
                param = params.get(name)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                _copy(param.data, tensor, name)
                loaded.add(name)
                continue
            prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
            target = f"{prefix}.down_proj" if part == "down_proj" else f"{prefix}.gate_up_proj"
            param = params.get(target)
            if param is None or expert >= param.shape[0]:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            dest = param.data[expert]
            if part != "down_proj":
                dest = dest.narrow(0, 0 if part == "gate_proj" else inter, inter)
            _copy(dest, tensor, name)
            loaded.add(f"{target}#{expert}.{part}")
        expected = set()
        per_expert = {n.split("#")[0] for n in loaded if "#" in n}
        for pname, param in params.items():
            if pname.endswith(".gate_up_proj") and not pname.endswith("experts.gate_up_proj"):
                expected |= {f"{pname}#gate_proj", f"{pname}#up_proj"}  # a dense MLP's halves
            elif pname.endswith("experts.gate_up_proj") and pname in per_expert:
                parts = ("gate_proj", "up_proj")
                expected |= {f"{pname}#{e}.{p}" for e in range(param.shape[0]) for p in parts}
            elif pname.endswith(".linear_attn.in_proj"):
                expected |= {f"{pname}#in_proj_qkvz", f"{pname}#in_proj_ba"}
            elif pname.endswith("experts.down_proj") and pname in per_expert:
                expected |= {f"{pname}#{e}.down_proj" for e in range(param.shape[0])}
            elif not (pname == "lm_head.weight" and self.tie_word_embeddings):
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")


def _copy(dest: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    check_shape(tensor, dest.shape, name)
    dest.copy_(tensor)

"""DeepSeek-V4 text model (HF transformers' `DeepseekV4ForCausalLM`, same config keys and
weight names, so a `save_pretrained` directory loads).

- attention: q LoRA (q_a_proj -> q_a_norm -> q_b_proj) and a weightless per-head RMS norm
  on q; one KV head read as both K and V; partial interleaved rope on the trailing
  channels ("main" rope on sliding layers, "compress" rope (YaRN, attention factor 1) on
  compressed layers and their entries), the inverse rope on the output; a learned sink
  per head; grouped output projection (o_groups x o_lora_rank, then o_b_proj). The cache
  and the attention itself are the v4 backend's (atom/attention/v4.py).
- mHC hyper-connections: `hc_mult` residual streams, mixed by Sinkhorn-projected weights
  around each block, collapsed by the head before the final norm.
- MoE: `sqrtsoftplus` scores, e_score_correction_bias for the choice only,
  routed_scaling_factor; hash layers route by `tid2eid[input_ids]`; a shared expert;
  SwiGLU clamp `swiglu_limit` on the routed and shared experts.
- A block-FP8 checkpoint (`quant_method: "fp8"`, `weight_scale_inv`; docs/quantization.md):
  the linears transformers' FP8 quantizer converts are held in FP8 (q_a | kv, q_b | the
  indexer's q_b, o_a, o_b, the shared expert, the routed experts: `Fp8Experts`); the
  compressor's and indexer's kv / gate and scorer projections stay dense (`DENSE_INPUT_PARTS`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from atom.attention.v4 import CompressorInputs, IndexerInputs, V4Attention, V4Family
from atom.distributed.tensor_parallel import ShardingError
from atom.kernels.activation import clamped_silu_and_mul, clamped_silu_and_mul_reference
from atom.kernels.moe_routing import v4_route
from atom.kernels.platform import use_cuda_path
from atom.kernels.v4_mhc import hc_head, hc_post, hc_pre
from atom.kernels.v4_rope import norm_rope, norm_rope_reference, rope_tables
from atom.models.deepseek_v2 import _yarn_inv_freq
from atom.models.deepseek_v4_checkpoint import (
    V4_EXPERT,
    checkpoint_targets,
    hf_name,
    load_checkpoint,
)
from atom.models.moe import SharedExpert, routed_experts
from atom.models.parallel_layers import (
    ColumnParallelLinear,
    checkpoint_linear,
    linear,
    linear_method_for,
    project,
)
from atom.models.quantization import FP8, read_quantization_scheme
from atom.models.quantization.experts import Fp8Experts
from atom.models.quantization.fp8 import quant_kernels_enabled


class FP32RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight, multiplied in fp32 and cast once (HF V4)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * y).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _inv_freq(config, kind: str) -> torch.Tensor:
    params = config.rope_parameters[kind]
    dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
    theta = float(params["rope_theta"])
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope_type == "yarn":
        inv_freq, factor = _yarn_inv_freq(dim, theta, params, config.max_position_embeddings)
        if factor != 1.0:
            raise ValueError("DeepSeek-V4 YaRN must have attention_factor 1")
        return inv_freq
    raise ValueError(f"unsupported rope type {rope_type!r} for DeepSeek-V4 (default, yarn)")


class Compressor(nn.Module):
    """One compressed branch (HF `compressor` / `compressor.indexer`): its kv and gate
    projections are rows of the attention's stacked input projection (`input_parts`)."""

    def __init__(self, config, dim: int, ratio: int, overlap: bool):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.eps = config.rms_norm_eps
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.kv_norm = FP32RMSNorm(dim, config.rms_norm_eps)

    def inputs(self, kv: torch.Tensor, gate: torch.Tensor) -> CompressorInputs:
        return CompressorInputs(kv, gate, self.position_bias, self.kv_norm.weight, self.eps)


class Indexer(Compressor):
    def __init__(self, config, ratio: int):
        super().__init__(config, config.index_head_dim, ratio, overlap=True)
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim


def stacked(input_size: int, parts: dict[str, int], quant_method=None) -> ColumnParallelLinear:
    """One weight for the linear layers `parts` (checkpoint module name -> rows) that read
    the same input: one GEMV at batch 1 where they were several; a checkpoint's parts load
    into their rows by name (`parallel_layers.part_targets`). `quant_method`: held quantized
    (FP8 block scales stay blocks where every part starts on a block row, else they become
    blocks of one row: exact either way, atom/models/quantization/fp8.py)."""
    names, sizes = list(parts), list(parts.values())
    return ColumnParallelLinear(
        input_size, sizes, bias=False, part_names=names, quant_method=quant_method
    )


# The input projections transformers keeps out of FP8 (DeepseekV4 `_keep_in_fp32_modules`:
# DeepSeek-V4-Flash ships them in bf16 without scales; the scorer's 64 rows are not a
# 128-row block). A quantized checkpoint's q_a | kv are stacked apart from them, and these
# load dense: an FP8 tensor for one of them is dequantized at load.
DENSE_INPUT_PARTS = (
    "compressor.kv_proj",
    "compressor.gate_proj",
    "compressor.indexer.kv_proj",
    "compressor.indexer.gate_proj",
    "compressor.indexer.scorer.weights_proj",
)


def input_parts(config, layer_type: str) -> dict[str, int]:
    """The rows of a V4 attention layer's projections of its input, by HF module name
    (relative to the attention), in the stacked weight's order: one GEMV at batch 1 where
    HF runs up to seven (q_a, kv, the compressor's kv and gate, the indexer's kv, gate
    and scorer weights)."""
    parts = {"q_a_proj": config.q_lora_rank, "kv_proj": config.head_dim}
    if layer_type != "sliding_attention":
        overlap = layer_type == "compressed_sparse_attention"
        width = (2 if overlap else 1) * config.head_dim
        parts.update({"compressor.kv_proj": width, "compressor.gate_proj": width})
        if overlap:
            index_width = 2 * config.index_head_dim
            parts.update({
                "compressor.indexer.kv_proj": index_width,
                "compressor.indexer.gate_proj": index_width,
                "compressor.indexer.scorer.weights_proj": config.index_n_heads,
            })  # fmt: skip
    return parts


class DeepseekV4Attention(nn.Module):
    def __init__(self, config, layer_idx: int, tables: dict, max_model_len: int):
        super().__init__()
        layer_type = config.layer_types[layer_idx]
        self.rope_kind = "main" if layer_type == "sliding_attention" else "compress"
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.o_groups, self.eps = config.o_groups, config.rms_norm_eps
        hidden, heads_dim = config.hidden_size, self.num_heads * self.head_dim
        scheme, prefix = read_quantization_scheme(config), f"model.layers.{layer_idx}.self_attn"
        parts, dense_parts = input_parts(config, layer_type), {}
        if scheme is not None:  # q_a | kv held as the checkpoint stores them, the rest dense
            dense_parts = {n: parts.pop(n) for n in DENSE_INPUT_PARTS if n in parts}
        method = linear_method_for(scheme, [f"{prefix}.{n}" for n in parts], f"{prefix}.input_proj")
        self.input_proj = stacked(hidden, parts, method)
        self.compressor_proj = stacked(hidden, dense_parts) if dense_parts else None
        self.q_a_norm = FP32RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        # q_b and the indexer's q_b both read the normed q_a: stacked too
        q_parts = {"q_b_proj": heads_dim}
        if layer_type == "compressed_sparse_attention":
            q_parts["compressor.indexer.q_b_proj"] = config.index_n_heads * config.index_head_dim
        names = [f"{prefix}.{n}" for n in q_parts]
        method = linear_method_for(scheme, names, f"{prefix}.query_proj")
        self.query_proj = stacked(config.q_lora_rank, q_parts, method)
        self.kv_norm = FP32RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_a_proj = checkpoint_linear(
            scheme, f"{prefix}.o_a_proj", heads_dim // config.o_groups,
            config.o_groups * config.o_lora_rank, bias=False,
        )  # fmt: skip
        o_b_inputs = config.o_groups * config.o_lora_rank
        self.o_b_proj = checkpoint_linear(scheme, f"{prefix}.o_b_proj", o_b_inputs, hidden, False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.compressor = None
        if layer_type != "sliding_attention":
            ratio = config.compress_rates[layer_type]
            overlap = layer_type == "compressed_sparse_attention"
            self.compressor = Compressor(config, self.head_dim, ratio, overlap)
            if overlap:
                self.compressor.indexer = Indexer(config, ratio)
        self.tables = tables
        self.attn = V4Attention(config, layer_type, tables["compress"], max_model_len)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        tables, fused = self.tables[self.rope_kind], use_cuda_path(hidden)
        projected = self.input_proj(hidden).split(self.input_proj.local_sizes, -1)
        if self.compressor_proj is not None:  # a quantized checkpoint's dense parts
            projected += self.compressor_proj(hidden).split(self.compressor_proj.local_sizes, -1)
        q_a, kv = projected[0], projected[1]
        q_residual = norm_then_rope(q_a[:, None], positions, None, fused, self.q_a_norm)[:, 0]
        q_all = self.query_proj(q_residual).split(self.query_proj.local_sizes, -1)
        q = q_all[0].view(-1, self.num_heads, self.head_dim)
        q = norm_then_rope(q, positions, tables, fused, eps=self.eps)
        kv = norm_then_rope(kv[:, None, :], positions, tables, fused, self.kv_norm)[:, 0]
        compressor = indexer = None
        if self.compressor is not None:
            compressor = self.compressor.inputs(projected[2], projected[3])
            if hasattr(self.compressor, "indexer"):
                index = self.compressor.indexer
                index_q = q_all[1].view(-1, index.num_heads, index.head_dim)
                index_q = norm_then_rope(index_q, positions, self.tables["compress"], fused)
                weights = projected[6].float() * index.num_heads**-0.5
                indexer = IndexerInputs(index.inputs(projected[4], projected[5]), index_q, weights)
        out = self.attn(q, kv, positions, self.sinks, compressor, indexer)
        out = norm_then_rope(out, positions, tables, fused, inverse=True)
        return grouped_output(out, self.o_groups, self.o_a_weight(out.dtype), self.o_b_proj)

    def o_a_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """o_a's weight for the grouped product; held in FP8 it is dequantized for it (the
        torch reference's way, on CUDA too: no grouped FP8 kernel yet)."""
        layer = self.o_a_proj
        if isinstance(layer, ColumnParallelLinear):
            return layer.quant_method.dequantize(layer, dtype)
        return layer.weight


def norm_then_rope(x, positions, tables, fused: bool, norm=None, eps=None, inverse=False,
                   round_normed=False):  # fmt: skip
    """x [T, H, D]: `norm` (an FP32RMSNorm, or with `round_normed` V4.1's RMSNorm; `eps` alone:
    the unweighted per-head norm; neither: none), then the interleaved rope at `positions`
    with `tables` (cos, sin) (None: none; `inverse`: -sin). `fused`: one launch
    (v4_rope.norm_rope), else the torch ops."""
    cos_table, sin_table = tables if tables is not None else (None, None)
    weight, eps = (norm.weight, norm.eps) if norm is not None else (None, eps)
    apply = norm_rope if fused else norm_rope_reference
    return apply(x, positions, cos_table, sin_table, weight, eps, inverse, round_normed)


def grouped_output(out: torch.Tensor, groups: int, a_weight: torch.Tensor, b_proj) -> torch.Tensor:
    """V4's grouped low-rank output projection: the heads' outputs [T, H, D] in `groups`
    groups, each through its own slice of `a_weight` (one batched matmul), then `b_proj`."""
    grouped = out.reshape(-1, groups, a_weight.shape[-1])  # a_weight: [groups * rank, width]
    weight = a_weight.view(groups, -1, grouped.shape[-1])
    grouped = torch.bmm(grouped.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)
    return project(b_proj, grouped.flatten(1))


class HyperConnection(nn.Module):
    """mHC weights of one block: (post [T, N], comb [T, N, N], collapsed input [T, D])."""

    def __init__(self, config):
        super().__init__()
        n = self.hc_mult = config.hc_mult
        self.iters, self.hc_eps, self.eps = (
            config.hc_sinkhorn_iters,
            config.hc_eps,
            config.rms_norm_eps,
        )
        self.fn = nn.Parameter(
            torch.zeros((2 + n) * n, n * config.hidden_size, dtype=torch.float32)
        )
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def mixes(self, streams: torch.Tensor):
        """(pre [T, N], post [T, N], comb [T, N, N]) from one projection of the streams."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n)
        comb = torch.softmax(comb, dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb

    def forward(self, streams: torch.Tensor, norm: FP32RMSNorm):
        """(post, comb, the block's input: `norm` of the collapsed streams); the CUDA path
        in two launches (atom/kernels/v4_mhc.py)."""
        if use_cuda_path(streams):
            return hc_pre(
                streams, self.fn.float(), self.base.float(), self.scale.float(),
                norm.weight.float(), self.iters, self.eps, self.hc_eps, norm.eps,
            )  # fmt: skip
        pre, post, comb = self.mixes(streams)
        return post, comb, norm(collapse(streams, pre))

    @staticmethod
    def expand(out: torch.Tensor, streams: torch.Tensor, post, comb) -> torch.Tensor:
        if use_cuda_path(streams):
            return hc_post(out, streams, post, comb)
        return expand(out, streams, post, comb)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [T, N, D] weighted by pre [T, N] -> [T, D]."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def expand(out: torch.Tensor, streams: torch.Tensor, post, comb) -> torch.Tensor:
    """Block output [T, D] into the streams: post_k * out + sum_j comb[j, k] * streams_j."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


class HyperHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        n = config.hc_mult
        self.eps, self.hc_eps = config.rms_norm_eps, config.hc_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * config.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, norm: FP32RMSNorm) -> torch.Tensor:
        """`norm` of the streams collapsed by the head's weights."""
        if use_cuda_path(streams):
            return hc_head(
                streams, self.hc_fn.float(), self.hc_base.float(), self.hc_scale.float(),
                norm.weight.float(), self.eps, self.hc_eps, norm.eps,
            )  # fmt: skip
        return norm(self.collapse(streams))

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class SwiGLUMLP(nn.Module):
    """down(silu(gate) * up), gate clamped to at most `limit` and up to [-limit, limit];
    `limit` None: no clamp (V4.1 with swiglu_limit <= 0; HF V4 clamps at any limit)."""

    def __init__(self, hidden: int, inter: int, limit: float | None, scheme=None, prefix=""):
        super().__init__()
        self.limit = limit
        self.gate_proj = checkpoint_linear(scheme, f"{prefix}.gate_proj", hidden, inter, False)
        self.up_proj = checkpoint_linear(scheme, f"{prefix}.up_proj", hidden, inter, False)
        self.down_proj = checkpoint_linear(scheme, f"{prefix}.down_proj", inter, hidden, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self.gate_proj, x), project(self.up_proj, x)
        act = clamped_silu_and_mul if use_cuda_path(x) else clamped_silu_and_mul_reference
        return project(self.down_proj, act(gate, up, self.limit))

    def shared_expert(self) -> SharedExpert:
        """This MLP as a MoE layer's shared expert, with its weights for the decode GEMV's
        extra pair where they are dense (a quantized one always runs its own forward)."""
        layers = (self.gate_proj, self.up_proj, self.down_proj)
        if any(isinstance(layer, ColumnParallelLinear) for layer in layers):
            return SharedExpert(self)
        return SharedExpert(self, tuple(layer.weight for layer in layers))


class DeepseekV4MoE(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        hidden, inter, experts = (
            config.hidden_size,
            config.moe_intermediate_size,
            config.n_routed_experts,
        )
        self.top_k, self.limit = config.num_experts_per_tok, config.swiglu_limit
        self.routed_scaling_factor = config.routed_scaling_factor
        if config.scoring_func != "sqrtsoftplus":
            raise ValueError(f"DeepSeek-V4: scoring_func {config.scoring_func!r} (sqrtsoftplus)")
        self.is_hash = config.mlp_layer_types[layer_idx] == "hash_moe"
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(experts, hidden))
        if self.is_hash:
            self.gate.register_buffer(
                "tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long)
            )
        else:
            self.gate.register_buffer(
                "e_score_correction_bias", torch.zeros(experts, dtype=torch.float32)
            )
        scheme, prefix = read_quantization_scheme(config), f"model.layers.{layer_idx}.mlp"
        if scheme is not None and scheme.kind == FP8 and scheme.quantizes(f"{prefix}.experts"):
            self.experts = Fp8Experts(experts, hidden, inter, scheme)  # read one expert at a time
        else:
            self.experts = nn.Module()
            self.experts.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * inter, hidden))
            self.experts.down_proj = nn.Parameter(torch.zeros(experts, hidden, inter))
        self.shared_experts = SwiGLUMLP(
            hidden, inter, self.limit, scheme, f"{prefix}.shared_experts"
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x, input_ids)
        experts = self.experts
        gate_up, down, fp8_scales = experts.gate_up_proj, experts.down_proj, None
        if isinstance(experts, Fp8Experts):
            if use_cuda_path(x) and quant_kernels_enabled():
                fp8_scales = experts.fp8_scales()  # the grouped kernels read the FP8 weights
            else:  # the reference (CPU), or ATOM_QUANT_KERNELS=0's A/B runs on CUDA
                gate_up, down, ids = experts.dense(ids, x.dtype)
        # routed + shared: on CUDA in the launch that sums the routed experts over k, and at
        # decode (bf16 experts) the shared expert one more pair of their GEMVs (a routed
        # expert's math: SwiGLU with the same clamp)
        return routed_experts(
            x, weights, ids, gate_up, down, self.limit, fp8_scales=fp8_scales,
            shared_expert=self.shared_experts.shared_expert(),
        )  # fmt: skip

    def route(self, x: torch.Tensor, input_ids: torch.Tensor):
        """(weights [T, k], expert ids [T, k]). The CUDA path in one launch after the gate's
        GEMM (atom/kernels/moe_routing.py: ties to the lower expert); the CPU path HF's ops
        (its `topk` orders ties as the implementation does)."""
        logits = F.linear(x, self.gate.weight)
        if use_cuda_path(x):
            if self.is_hash:
                return v4_route(
                    logits, self.top_k, self.routed_scaling_factor,
                    input_ids=input_ids, tid2eid=self.gate.tid2eid,
                )  # fmt: skip
            bias = self.gate.e_score_correction_bias
            return v4_route(logits, self.top_k, self.routed_scaling_factor, bias=bias)
        scores = F.softplus(logits).sqrt()
        if self.is_hash:
            ids = self.gate.tid2eid[input_ids]
        else:
            choice = scores + self.gate.e_score_correction_bias
            ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, tables: dict, max_model_len: int):
        super().__init__()
        self.self_attn = DeepseekV4Attention(config, layer_idx, tables, max_model_len)
        self.mlp = DeepseekV4MoE(config, layer_idx)
        self.input_layernorm = FP32RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = FP32RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams, positions, input_ids):
        """streams [T, hc_mult, D] -> the same."""
        post, comb, x = self.attn_hc(streams, self.input_layernorm)
        streams = self.attn_hc.expand(self.self_attn(positions, x), streams, post, comb)
        post, comb, x = self.ffn_hc(streams, self.post_attention_layernorm)
        return self.ffn_hc.expand(self.mlp(x, input_ids), streams, post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, config, max_model_len: int):
        super().__init__()
        self.hc_mult = config.hc_mult
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        max_position = max(max_model_len, 1)
        # cos/sin tables shared by every layer (not parameters; HF keeps them as buffers)
        self.tables = {
            kind: tuple(
                t.to(self.embed_tokens.weight.device)
                for t in rope_tables(_inv_freq(config, kind), max_position)
            )
            for kind in ("main", "compress")
        }
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(config, i, self.tables, max_model_len)
            for i in range(config.num_hidden_layers)
        )
        self.norm = FP32RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, positions, input_ids)
        return self.hc_head(streams, self.norm)


class DeepseekCausalLM(nn.Module):
    """What V4 and V4.1 share around their model: one process (no tensor parallelism yet),
    the forward and the LM head. A subclass sets `model`, `lm_head` and `model_type`."""

    model_type = "deepseek_v4"

    @classmethod
    def validate_tensor_parallel(cls, config, world_size: int) -> None:
        if world_size > 1:
            raise ShardingError(
                f"{cls.model_type}: tensor parallelism is not supported yet; run with "
                "--tensor-parallel-size 1"
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head.weight)


class DeepseekV4ForCausalLM(DeepseekCausalLM):
    @classmethod
    def family(cls, config) -> V4Family:
        """The attention family the engine asks (its slots get V4Backends)."""
        return V4Family()

    def __init__(self, config, max_position: int | None = None, tp=None):
        super().__init__()
        self.validate_tensor_parallel(config, 1 if tp is None else tp.world_size)
        self.config = config
        self.model = DeepseekV4Model(config, max_position or config.max_position_embeddings)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[V4Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in: HF module names, or the DeepSeek names HF's
        `save_pretrained` writes for V4 (`attn.wq_a`, `ffn.experts.N.w1`, ...; see
        `hf_name`). Every parameter and routing buffer must be set; MTP layers are skipped."""
        targets = checkpoint_targets(self)

        def name_of(source: str) -> str | None:
            if source.startswith("mtp.") or ".mtp." in source or "rotary_emb" in source:
                return None
            return source if source in targets else hf_name(source)

        load_checkpoint(self.config, targets, weights, name_of, V4_EXPERT)

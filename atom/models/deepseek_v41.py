"""DeepSeek-V4.1 text model (upstream HF `deepseek_v41`, model_type `deepseek_v41_text`),
read from config.json and checkpoint-native weight names (`model.layers.N.attn.wq_a`, ...).

Against V4 (atom/models/deepseek_v4.py, whose pieces it reuses):
- attention: no per-head q norm; the window K=V is FP8-fake-quantised; per-layer
  `compress_ratios` with KV-source sharing, index sources with a two-level top-k, FP4 fake
  quantisation of the compressed KV and the indexer q/k (atom/attention/v41.py,
  atom/kernels/v41_*.py).
- mHC: each site's `pre` collapses the streams at the *next* site (the first attention
  collapses stream 0 only, the final norm takes the last FFN site's `pre`); no head.
- router: logits / `gate_temp`, sqrtsoftplus, fp32 `bias` for the choice only (`bias_vl`
  is for image tokens: unused here); one shared expert; routed experts through
  atom/models/moe.py `routed_experts` (at decode on CUDA the shared expert runs as one more
  pair of the routed experts' GEMVs: `SharedExpert`).
- Engram on `engram_layer_ids`: hashed n-gram rows, a gated add to every stream
  (atom/kernels/v41_engram.py: Triton hashing on CUDA; the lookup is the torch reference,
  which a Triton lookup lost to: docs/benchmarks.md); its history is the sequence's state (the first layer's
  `engram_tokens` state rows), read and written in `EngramHashes`.
On the CUDA path (and on CPU under `ATOM_INTERPRET_CUDA_PATH=1`) the mHC sites, the norms +
ropes, the final norm and the routing run V4's fused kernels in V4.1's variants (carried
`pre`, `round_normed`, `round_once`, `temperature`); the torch ops stay the CPU path.
DSpark draft layers (`mtp.*`) and vision weights are skipped with one log line.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from atom.attention.v41 import (
    IndexerInputs,
    SharedChoice,
    SourceInputs,
    V41Attention,
    V41Family,
)
from atom.forward_context import get_forward_context
from atom.kernels import v41_quant
from atom.kernels.gemv import gemv
from atom.kernels.moe_routing import v4_route
from atom.kernels.platform import use_cuda_path
from atom.kernels.v4_mhc import hc_collapse, hc_post, hc_pre_carried
from atom.kernels.v4_rope import norm_rope, rope_tables
from atom.kernels.v41_engram import (
    compressed_token_map,
    engram_hash,
    engram_hash_reference,
    engram_multipliers,
    engram_offsets,
    engram_primes,
    engram_reference,
)
from atom.models.deepseek_v4 import (
    DeepseekCausalLM,
    HyperConnection,
    SwiGLUMLP,
    _inv_freq,
    collapse,
    grouped_output,
    norm_then_rope,
    stacked,
)
from atom.models.deepseek_v4_checkpoint import load_checkpoint
from atom.models.moe import SharedExpert, routed_experts
from atom.models.parallel_layers import linear, part_targets

logger = logging.getLogger(__name__)


def fake_quant_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    """Triton on the CUDA path, the torch reference on CPU (atom/kernels/v41_quant.py)."""
    if use_cuda_path(x):
        return v41_quant.fake_quant_fp8(x, block)
    return v41_quant.fake_quant_fp8_reference(x, block)


def fake_quant_fp4(x: torch.Tensor, block: int, e4m3_scales: bool = False) -> torch.Tensor:
    if use_cuda_path(x):
        return v41_quant.fake_quant_fp4(x, block, e4m3_scales)
    return v41_quant.fake_quant_fp4_reference(x, block, e4m3_scales)


def _latest(ids, layer_idx: int) -> int | None:
    earlier = [i for i in ids if i <= layer_idx]
    return max(earlier) if earlier else None


# Rounding points: the reference's order of operations (as many ops as V4's; in fp32 the
# same results bit for bit). V4 (HF) multiplies the norm weight in fp32 and expands the mHC
# streams in the model dtype; the V4.1 reference does neither (docs/architecture.md).
class RMSNorm(nn.Module):
    """Normalised in fp32, rounded to the input dtype, then times the weight (held in the
    model's dtype, as the reference holds it): ``weight * normed.to(dtype)``."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """`fused`: the CUDA path's one launch (v4_rope.norm_rope, `round_normed`)."""
        if fused:
            rows = x.reshape(-1, 1, x.shape[-1])
            out = norm_rope(rows, None, None, None, self.weight, self.eps, round_normed=True)
            return out.view(x.shape)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def expand(out: torch.Tensor, streams: torch.Tensor, post, comb) -> torch.Tensor:
    """post_k * out + sum_j comb[j, k] * streams_j in fp32 (the reference), cast once."""
    mixed = torch.matmul(comb.float().transpose(-1, -2), streams.float())
    return (post.float().unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(streams.dtype)


# The CUDA path of an mHC site runs V4's fused kernels (atom/kernels/v4_mhc.py) in V4.1's
# variants: the collapse by the carried `pre`, the norm rounded as `RMSNorm`, the expand
# rounded once. The torch ops above stay the CPU path and the reference.
def site_input(hc: HyperConnection, streams: torch.Tensor, pre: torch.Tensor, norm: RMSNorm):
    """(this site's pre, post, comb, the block's input: `norm` of the streams collapsed by
    `pre`, the previous site's)."""
    if use_cuda_path(streams):
        return hc_pre_carried(
            streams, pre, hc.fn.float(), hc.base.float(), hc.scale.float(), norm.weight,
            hc.iters, hc.eps, hc.hc_eps, norm.eps,
        )  # fmt: skip
    site_pre, post, comb = hc.mixes(streams)
    return site_pre, post, comb, norm(collapse(streams, pre))


def site_output(out: torch.Tensor, streams: torch.Tensor, post, comb) -> torch.Tensor:
    """The block's output expanded into the streams (`expand`)."""
    if use_cuda_path(streams):
        return hc_post(out, streams, post, comb, round_once=True)
    return expand(out, streams, post, comb)


class Compressor(nn.Module):
    """A KV source's compressor: its wkv (and wgate) are rows of the attention's stacked
    projections (ratio 1: of `input_proj`; else of `pool_proj`, whose product is fp32)."""

    def __init__(self, config, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.norm = RMSNorm(config.head_dim, config.rms_norm_eps)


class Indexer(nn.Module):
    """An index layer's scorer: its wq_b and weights_proj are rows of the attention's
    stacked projections; a key-owning source also projects its latent (wk)."""

    def __init__(self, config, owns_keys: bool):
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        if owns_keys:
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def inputs(self, q, weights, positions, tables, fused: bool) -> IndexerInputs:
        q = q.view(-1, self.num_heads, self.head_dim)
        q = fake_quant_fp4(norm_then_rope(q, positions, tables, fused), 32)
        return IndexerInputs(q, weights.float() * self.num_heads**-0.5)


def pool_projection(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The compressor's fp32 product of the block input (the reference pools in fp32):
    ``F.linear(x.float(), weight.float())``; at one row on the CUDA path the GEMV's fp32
    sums (no fp32 copy of the weight)."""
    if use_cuda_path(x) and x.shape[0] == 1:
        return gemv(x, weight, out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())


class DeepseekV41Attention(nn.Module):
    def __init__(self, config, layer_idx: int, tables: dict, max_model_len: int):
        super().__init__()
        self.ratio = config.compress_ratios[layer_idx]
        self.rope_kind = "compress" if self.ratio else "main"
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.o_groups = config.o_groups
        hidden, heads_dim = config.hidden_size, self.num_heads * self.head_dim
        engram_history = (
            config.engram_max_ngram_size - 1 if (layer_idx == 0 and config.engram_layer_ids) else 0
        )
        self.attn = V41Attention(config, layer_idx, max_model_len, engram_history)
        # The projections of the block's input in one weight (q_a, the window's kv, the
        # indexer's weights, a ratio-1 source's latent), q_b with the indexer's q_b in one,
        # the pooled source's kv and gate in one (fp32 out)
        inputs = {"wq_a": config.q_lora_rank, "wkv": self.head_dim}
        q_parts = {"wq_b": heads_dim}
        self.compressor = self.pool_proj = None
        if self.attn.is_source:
            self.compressor = Compressor(config, self.ratio)
            if self.ratio == 1:
                inputs["compressor.wkv"] = self.head_dim
            else:
                self.pool_proj = stacked(
                    hidden, {"compressor.wkv": self.head_dim, "compressor.wgate": self.head_dim}
                )
        self.indexer = Indexer(config, self.attn.owns_keys) if self.attn.is_index else None
        if self.indexer is not None:
            inputs["indexer.weights_proj"] = config.index_n_heads
            q_parts["indexer.wq_b"] = config.index_n_heads * config.index_head_dim
        self.input_parts = list(inputs)
        self.input_proj = stacked(hidden, inputs)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.query_proj = stacked(config.q_lora_rank, q_parts)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.wo_a = nn.Linear(
            heads_dim // config.o_groups, config.o_groups * config.o_lora_rank, bias=False
        )
        self.wo_b = nn.Linear(config.o_groups * config.o_lora_rank, hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.tables = tables

    def _finish(self, latent: torch.Tensor, group_positions: torch.Tensor):
        """Pre-RoPE latents [G, D] at their groups' first positions -> (entries, keys)."""
        tables, fused = self.tables["compress"], use_cuda_path(latent)
        # pooled in fp32: cast to the model's dtype before the norm, as the reference does
        latent = self.compressor.norm(latent.to(self.input_proj.weight.dtype), fused)
        entries = norm_then_rope(latent[:, None, :], group_positions, tables, fused)[:, 0]
        entries = fake_quant_fp4(entries, 16, e4m3_scales=True)
        keys = None
        if self.attn.owns_keys:
            keys = linear(latent, self.indexer.wk.weight)[:, None, :]
            keys = norm_then_rope(
                keys, group_positions, tables, fused, self.indexer.k_norm, round_normed=True
            )[:, 0]
            keys = fake_quant_fp4(keys, 32)
        return entries, keys

    def forward(self, positions, hidden, shared: SharedChoice) -> torch.Tensor:
        tables, fused = self.tables[self.rope_kind], use_cuda_path(hidden)
        parts = self.input_proj(hidden).split(self.input_proj.local_sizes, -1)
        projected = dict(zip(self.input_parts, parts, strict=True))
        q_residual = norm_then_rope(
            projected["wq_a"][:, None], positions, None, fused, self.q_norm, round_normed=True
        )[:, 0]
        q_all = self.query_proj(q_residual).split(self.query_proj.local_sizes, -1)
        q = q_all[0].view(-1, self.num_heads, self.head_dim)
        q = norm_then_rope(q, positions, tables, fused)
        kv = projected["wkv"][:, None, :]
        kv = norm_then_rope(kv, positions, tables, fused, self.kv_norm, round_normed=True)[:, 0]
        kv = fake_quant_fp8(kv, 32)
        source = indexer = None
        if self.compressor is not None:
            if self.pool_proj is None:  # ratio 1: the latent itself, normed in `_finish`
                source = SourceInputs(projected["compressor.wkv"], None, self._finish)
            else:  # pooled in fp32
                kv_raw, gate = pool_projection(hidden, self.pool_proj.weight).split(
                    self.pool_proj.local_sizes, -1
                )
                source = SourceInputs(kv_raw, gate, self._finish)
        if self.indexer is not None:
            indexer = self.indexer.inputs(
                q_all[1], projected["indexer.weights_proj"], positions, self.tables["compress"],
                fused,
            )  # fmt: skip
        out = self.attn(q, kv, positions, self.attn_sink, source, indexer, shared)
        out = norm_then_rope(out, positions, tables, fused, inverse=True)
        return grouped_output(out, self.o_groups, self.wo_a.weight, self.wo_b)


class DeepseekV41MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, inter, experts = (
            config.hidden_size,
            config.moe_intermediate_size,
            config.n_routed_experts,
        )
        if config.scoring_func != "sqrtsoftplus":
            raise ValueError(f"DeepSeek-V4.1: scoring_func {config.scoring_func!r} (sqrtsoftplus)")
        # the reference clamps routed and shared experts only at a positive limit
        limit = config.swiglu_limit
        self.top_k, self.limit = config.num_experts_per_tok, limit if limit > 0 else None
        self.gate_temp, self.norm_topk = config.gate_temp, config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.gate.bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32))
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * inter, hidden))
        self.experts.down_proj = nn.Parameter(torch.zeros(experts, hidden, inter))
        self.shared_experts = SwiGLUMLP(hidden, inter, self.limit)

    def route(self, x: torch.Tensor):
        """(weights [T, k] fp32, expert ids [T, k]) from the fp32 gate logits / gate_temp.
        The CUDA path in one launch after the gate's GEMM (atom/kernels/moe_routing.py
        `v4_route`, which renormalizes: used where the reference does)."""
        logits = F.linear(x.float(), self.gate.weight.float())
        bias = self.gate.bias.float()
        if use_cuda_path(x) and self.norm_topk and self.top_k > 1:
            return v4_route(
                logits, self.top_k, self.routed_scaling_factor, bias=bias,
                temperature=self.gate_temp,
            )  # fmt: skip
        scores = F.softplus(logits / self.gate_temp).sqrt()
        ids = (scores + bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        # routed + shared: on CUDA in the launch that sums the routed experts over k, and at
        # decode the shared expert one more pair of their GEMVs: a routed expert's math (SwiGLU,
        # the same limit and width; its weight 1 before w2 leaves its activation as it is)
        mlp = self.shared_experts
        halves = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        return routed_experts(
            x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj, self.limit,
            weight_before_down=True,  # the reference weights an expert's input to w2
            shared_expert=SharedExpert(mlp, halves),
        )  # fmt: skip


class Engram(nn.Module):
    def __init__(self, config, rows: int):
        super().__init__()
        cols = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        self.eps = config.rms_norm_eps
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.zeros(rows, config.engram_head_dim))
        self.wkv = nn.Linear(
            cols * config.engram_head_dim, config.hidden_size * (config.hc_mult + 1), bias=False
        )
        self.q_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size))
        self.k_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size))

    def forward(self, streams, hash_ids):
        # the torch reference on CUDA too: a Triton lookup lost to it (docs/benchmarks.md)
        return engram_reference(
            streams,
            hash_ids,
            self.embed.weight,
            self.wkv.weight,
            self.q_weight,
            self.k_weight,
            self.eps,
        )


class EngramHashes(nn.Module):
    """Hash ids of every token for every engram layer, from the tokens of this step and
    the sequence's history (its state rows `engram_tokens` [slots + 1, N - 1, 1]:
    compressed id of position p at row p % (N - 1)), which it then updates."""

    def __init__(self, config, token_map: list[int]):
        super().__init__()
        n, heads = config.engram_max_ngram_size, config.engram_n_heads
        layers = list(config.engram_layer_ids)
        primes = engram_primes(len(layers), n, heads, config.engram_vocab_size)
        self.register_buffer("primes", torch.tensor(primes, dtype=torch.int64), persistent=False)
        offsets = torch.tensor(engram_offsets(primes), dtype=torch.int64)
        self.register_buffer("offsets", offsets, persistent=False)
        multipliers = engram_multipliers(layers, n, config.engram_compressed_vocab_size)
        multipliers = multipliers.to(self.primes.device)  # numpy-made: on the CPU
        self.register_buffer("multipliers", multipliers, persistent=False)
        self.register_buffer(
            "token_map", torch.tensor(token_map, dtype=torch.int64), persistent=False
        )
        self.pad = token_map[config.engram_pad_id]
        self.max_ngram = n

    def tokens(self, input_ids, positions, history: V41Attention) -> torch.Tensor:
        """Compressed ids [T, N]: column s = the token s positions back (pad before 0)."""
        ids = self.token_map[input_ids]
        positions = positions.long()
        meta = get_forward_context().attention
        n, device = self.max_ngram, ids.device
        shifts = torch.arange(n, device=device)
        back = positions[:, None] - shifts  # [T, N] absolute positions
        if meta.block_tables is None:  # profiling: one sequence, no history
            index = torch.arange(ids.shape[0], device=device)[:, None] - shifts
            tokens = ids[index.clamp(min=0)]
            return torch.where((back >= 0) & (index >= 0), tokens, self.pad)
        ring = history.engram_tokens[..., 0]  # [slots + 1, N - 1]
        slots = meta.state_slots
        scratch = ring.shape[0] - 1
        if meta.is_decode:
            rows = torch.arange(ids.shape[0], device=device)
            chunk_start = positions
            token_index = rows
        else:
            cu = meta.cu_seqlens_q.long()
            token_index = torch.arange(ids.shape[0], device=device)
            rows = torch.searchsorted(cu[1:], token_index, right=True)
            chunk_start = positions - (token_index - cu[rows])
        row_slots = torch.where(slots[rows] < 0, scratch, slots[rows]).long()
        in_chunk = back >= chunk_start[:, None]
        from_chunk = ids[(token_index[:, None] - shifts).clamp(min=0)]
        from_ring = ring[row_slots[:, None], back.clamp(min=0) % (n - 1)]
        tokens = torch.where(in_chunk, from_chunk, from_ring)
        tokens = torch.where(back >= 0, tokens, self.pad)
        # the last N - 1 tokens of each chunk become the history (a decode row: its token)
        if meta.is_decode:
            last = torch.ones_like(positions, dtype=torch.bool)
        else:
            chunk_end = meta.context_lens.long()[rows]
            last = positions >= chunk_end - (n - 1)
        write_slots = torch.where(last, row_slots, scratch)
        ring[write_slots, positions % (n - 1)] = torch.where(
            last, ids, ring[write_slots, positions % (n - 1)]
        )
        return tokens

    def forward(self, input_ids, positions, history: V41Attention) -> torch.Tensor:
        tokens = self.tokens(input_ids, positions, history)
        hash_ids = engram_hash if use_cuda_path(tokens) else engram_hash_reference  # Triton
        return hash_ids(tokens, self.multipliers, self.primes, self.offsets)


class DeepseekV41DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, tables: dict, max_model_len: int):
        super().__init__()
        self.attn = DeepseekV41Attention(config, layer_idx, tables, max_model_len)
        self.ffn = DeepseekV41MoE(config)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)
        self.engram = None
        if layer_idx in config.engram_layer_ids:
            index = list(config.engram_layer_ids).index(layer_idx)
            self.engram_index = index
            self.engram = Engram(config, config.engram_num_embeddings[index])

    def forward(self, streams, pre, positions, hash_ids, shared):
        """streams [T, hc, D], pre [T, hc] (the previous site's) -> (streams, this pre)."""
        if self.engram is not None:
            streams = self.engram(streams, hash_ids[:, self.engram_index])
        attn_pre, post, comb, x = site_input(self.attn_hc, streams, pre, self.attn_norm)
        streams = site_output(self.attn(positions, x, shared), streams, post, comb)
        ffn_pre, post, comb, x = site_input(self.ffn_hc, streams, attn_pre, self.ffn_norm)
        return site_output(self.ffn(x), streams, post, comb), ffn_pre


class DeepseekV41Model(nn.Module):
    def __init__(self, config, max_model_len: int, token_map: list[int] | None):
        super().__init__()
        self.hc_mult = config.hc_mult
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        max_position = max(max_model_len, 1)
        device = self.embed.weight.device
        self.tables = {
            kind: tuple(t.to(device) for t in rope_tables(_inv_freq(config, kind), max_position))
            for kind in ("main", "compress")
        }
        self.layers = nn.ModuleList(
            DeepseekV41DecoderLayer(config, i, self.tables, max_model_len)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hashes = EngramHashes(config, token_map) if config.engram_layer_ids else None
        _link_sources(config, [layer.attn.attn for layer in self.layers])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0  # the first site collapses stream 0
        hash_ids = None
        if self.hashes is not None:
            hash_ids = self.hashes(input_ids, positions, self.layers[0].attn.attn)
        shared = SharedChoice()
        for layer in self.layers:
            streams, pre = layer(streams, pre, positions, hash_ids, shared)
        if use_cuda_path(streams):
            return hc_collapse(streams, pre, self.norm.weight, self.norm.eps)
        return self.norm(collapse(streams, pre))


def _link_sources(config, layers: list[V41Attention]) -> None:
    for i, layer in enumerate(layers):
        if not layer.ratio:
            continue
        source = _latest(config.kv_source_layer_ids, i)
        index = _latest(config.index_source_layer_ids, i)
        if source is None or index is None or not layers[source].ratio:
            raise ValueError(
                f"deepseek_v41 layer {i} (compress ratio {layer.ratio}) has no KV source and "
                "index source at or before it (kv_source_layer_ids, index_source_layer_ids)"
            )
        keys = [s for s in config.kv_source_layer_ids if s <= i and layers[s].owns_keys]
        layer.link(layers[source], layers[max(keys)] if keys and layer.is_index else None)
        if layer.is_index and layer.key_source is None:
            raise ValueError(f"deepseek_v41 index layer {i} has no KV source with indexer keys")


class DeepseekV41ForCausalLM(DeepseekCausalLM):
    model_type = "deepseek_v41"

    @classmethod
    def family(cls, config) -> V41Family:
        """The attention family the engine asks (its slots get V41Backends)."""
        return V41Family()

    def __init__(self, config, max_position: int | None = None, tp=None):
        super().__init__()
        self.validate_tensor_parallel(config, 1 if tp is None else tp.world_size)
        self.config = config
        token_map = _engram_token_map(config) if config.engram_layer_ids else None
        self.model = DeepseekV41Model(
            config, max_position or config.max_position_embeddings, token_map
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed.weight

    @property
    def attention_layers(self) -> list[V41Attention]:
        return [layer.attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint-native tensors in (see `module_name`); every parameter must be
        set. DSpark (`mtp.*`) and vision tensors are skipped with one log line."""
        skipped = 0

        def name_of(source: str) -> str | None:
            nonlocal skipped
            if _SKIPPED.match(source):
                skipped += 1
                return None
            if source.endswith(("gate.bias_vl", "embed.scale")):
                return None  # image tokens only / fp8 tables only
            return module_name(source)

        targets = dict(self.named_parameters(remove_duplicate=False))
        part_targets(self, targets)  # the stacked projections' parts, by checkpoint name
        load_checkpoint(self.config, targets, weights, name_of, _EXPERT)
        if skipped:
            logger.info("deepseek_v41: skipped %d DSpark / vision tensors (not supported)", skipped)


def _engram_token_map(config) -> list[int]:
    """The tokenizer-derived compressed token map (the model directory's tokenizer.json)."""
    path = os.path.join(getattr(config, "_name_or_path", "") or "", "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"deepseek_v41 engram layers need the model's tokenizer.json (not found at {path}): "
            "the n-gram hashes use the tokenizer-derived compressed token map"
        )
    token_map, size = compressed_token_map(path)
    if size != config.engram_compressed_vocab_size:
        raise ValueError(
            f"{path}: the compressed vocabulary has {size} ids, config.json says "
            f"engram_compressed_vocab_size {config.engram_compressed_vocab_size}; the engram "
            "hashes would not match the tables"
        )
    return token_map


_SKIPPED = re.compile(r"^(mtp\.|.*\.mtp\.|vision\.|aligner\.|image_(start|end|newline)$)")
_EXPERT = re.compile(r"(.*\.ffn\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_RENAMES = [
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]


def module_name(name: str) -> str:
    """This module's name of a checkpoint-native V4.1 tensor (the same names except the mHC
    parameters `hc_attn_fn` -> `attn_hc.fn` and the shared expert's w1/w2/w3)."""
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name

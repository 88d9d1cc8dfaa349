"""Llama-family decoder (Llama 2/3, SmolLM, Qwen2 with qkv bias, Mistral without sliding window).

Weights use HF names; q/k/v and gate/up are fused into one matmul each and split on
load (`load_weights`). With a TensorParallelGroup of N ranks each rank holds 1/N of the
heads, of the MLP's intermediate features and of the vocabulary (parallel_layers.py).
With a PipelineGroup a rank builds and loads only its stage: its range of decoder layers,
the embedding on the first stage, the final norm and the LM head on the last (a tied LM
head on a last stage without the embedding loads the embedding's tensor).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from atom.attention.family import AttentionFamily
from atom.attention.mha import MHAAttention
from atom.distributed import PipelineGroup, TensorParallelGroup, shard_range, stage_layer_range
from atom.forward_context import current_fusions
from atom.kernels.gemv import gemv_rms_norm, gemv_silu_and_mul
from atom.kernels.gemv_policy import use_gemv
from atom.kernels.gemv_rope_kv import gemv_rope_kv
from atom.kernels.pdl import latency_bound
from atom.models.layers import (
    DecoderStack,
    MissingLayer,
    PreNormDecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    rope_parameters,
    stage_layers,
)
from atom.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    linear_method_for,
    load_parameter,
)
from atom.models.quantization import read_quantization_scheme
from atom.models.quantization.fp8 import Fp8LinearMethod


def _fused_kernels_on(x: torch.Tensor) -> bool:
    """Whether the fused GEMV paths (atom/fusions.py) may run on x: CUDA only (on CPU the
    engine keeps the torch references; tests point this at the Triton interpreter)."""
    return x.is_cuda


def _gemv_weight(linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """What the fused batch-1 GEMVs read of a linear layer: (weight, None) for a dense one,
    (e4m3 weight, its float32 scale per row) for FP8 with one scale per output row; None for
    any other quantized layer (int4, block-scaled FP8: their own kernels, unfused)."""
    method = linear.quant_method
    if method is None:
        return linear.weight, None
    if isinstance(method, Fp8LinearMethod):
        scale = method.row_scale(linear)
        return None if scale is None else (linear.weight, scale)
    return None


def _num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _quant(config, prefix: str, *names: str):
    """The linear method of the layer holding HF linears `prefix`.`names` (None: dense)."""
    scheme = read_quantization_scheme(config)
    return linear_method_for(scheme, [f"{prefix}.{name}" for name in names], prefix)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rotary(config, max_position: int) -> RotaryEmbedding:
    theta, scaling = rope_parameters(config)
    return RotaryEmbedding(
        _head_dim(config), max_position, theta, scaling, config.max_position_embeddings
    )


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config,
        max_position: int,
        tp: TensorParallelGroup,
        prefix: str = "",
        rotary: RotaryEmbedding | None = None,
    ):
        """``rotary``: the model's one RotaryEmbedding, shared by its layers (a new one
        without it)."""
        super().__init__()
        total_heads = config.num_attention_heads
        self.head_dim = _head_dim(config)
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, _num_kv_heads(config), bias, tp,
            quant_method=_quant(config, prefix, "q_proj", "k_proj", "v_proj"),
        )  # fmt: skip
        # Heads on this rank (all of them with one rank).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, config.hidden_size, False, tp,
            quant_method=_quant(config, prefix, "o_proj"),
        )  # fmt: skip
        self.rotary = rotary or _rotary(config, max_position)
        # a latency-bound qkv GEMV lets paged decode start early under PDL (batch 1): its
        # cached K / V are then loaded before the wait (atom/kernels/decode_attention.py)
        self.attn = MHAAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
            early_kv=latency_bound(self.qkv_proj.weight),
        )  # fmt: skip

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention and o_proj from the fused q | k | v projection's output."""
        if not qkv.is_cuda:  # q | k rotated in one pass, the step's rotary rows shared
            tokens, qk_size = qkv.shape[0], self.q_size + self.kv_size
            qk = self.rotary.rotate(positions, qkv[:, :qk_size].view(tokens, -1, self.head_dim))
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)
            return self.o_proj(self.attn.forward(q, k, v))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn.forward_rotary(positions, q, k, v, self.rotary))

    def attend_cached(self, q: torch.Tensor) -> torch.Tensor:
        """Attention and o_proj from the rotated q [T, Hq * D], this step's K/V cached."""
        q = q.view(-1, self.num_heads, self.head_dim)
        return self.o_proj(self.attn.forward_cached(q))


# A CPU forward of more rows than this runs the MLP in blocks of at most this many rows: a block's
# [rows, 2 x intermediate] activations stay in the caches between its GEMMs and SiLU x up,
# where a whole 8192-token prefill's (100 MB for SmolLM2) go to memory and back
# (docs/benchmarks.md, CPU section).
CPU_MLP_BLOCK_ROWS = 512


def silu_and_mul_in_place(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [rows, 2 * I] (gate | up) projection that nobody reads after:
    the SiLU overwrites the gate half, so only the product is a new tensor. The same values
    as `silu_and_mul_reference`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate, inplace=True).mul(up)


class LlamaMLP(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup, prefix: str = ""):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [inter, inter], False, tp,
            quant_method=_quant(config, prefix, "gate_proj", "up_proj"),
        )  # fmt: skip
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, False, tp, quant_method=_quant(config, prefix, "down_proj")
        )
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = None
        if _fused_kernels_on(x) and current_fusions().gemv_silu:
            gate_up = _gemv_weight(self.gate_up_proj)  # dense or per-row-scaled FP8
        if gate_up is not None and use_gemv(x, gate_up[0], True, weight_scale=gate_up[1]):
            # one kernel, no SiLU pass
            weight, scale = gate_up
            return self.down_proj(gemv_silu_and_mul(x, weight, weight_scale=scale))
        if x.is_cuda:
            return self.down_proj(self.act(self.gate_up_proj(x)))
        rows = x.shape[0]
        if rows <= CPU_MLP_BLOCK_ROWS:
            return self.down_proj(silu_and_mul_in_place(self.gate_up_proj(x)))
        # blocks of near-equal size (they differ by < one row per block): never a short last
        # block, which would take another kernel (a 1-row one the GEMV's)
        size = -(-rows // -(-rows // CPU_MLP_BLOCK_ROWS))
        out = x.new_empty(rows, self.down_proj.output_size)
        for start in range(0, rows, size):
            block = slice(start, start + size)
            out[block] = self.down_proj(silu_and_mul_in_place(self.gate_up_proj(x[block])))
        return out


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        config,
        max_position: int,
        tp: TensorParallelGroup,
        prefix: str = "",
        rotary: RotaryEmbedding | None = None,
    ):
        super().__init__()
        # prefix: the layer's HF module name (model.layers.<i>), for a quantized checkpoint
        self.self_attn = LlamaAttention(config, max_position, tp, f"{prefix}.self_attn", rotary)
        self.mlp = LlamaMLP(config, tp, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        attention, mlp, norm = self.self_attn, self.mlp, self.input_layernorm
        qkv_bias = attention.qkv_proj.bias  # Qwen2's: added in the GEMV's epilogue
        if not (
            _fused_kernels_on(hidden)
            and current_fusions().norm_gemv
            and norm.weight.dtype == hidden.dtype
        ):
            return super().forward(positions, hidden, residual)
        # the fused GEMVs read dense weights, or FP8 ones with a scale per row
        qkv_weights = _gemv_weight(attention.qkv_proj)
        gate_up_weights = _gemv_weight(mlp.gate_up_proj)
        if qkv_weights is None or gate_up_weights is None:
            return super().forward(positions, hidden, residual)
        qkv_weight, qkv_scale = qkv_weights
        qkv_args = dict(bias=qkv_bias, weight_scale=qkv_scale)  # the qkv layer's
        # Fusions.norm_gemv: each RMSNorm (and its residual add) inside the GEMV after it,
        # where the GEMV policy measured that GEMV faster (use_gemv: with the RoPE + KV
        # epilogue where that runs); else the norm kernels and the MLP as without it.
        rope = attention.attn.rope_kv(positions, attention.rotary, attention.num_heads)
        if rope is not None and not rope.fits(hidden, qkv_weight):
            rope = None
        if not use_gemv(hidden, qkv_weight, norm=True, rope=rope, **qkv_args):
            return super().forward(positions, hidden, residual)
        if rope is not None:  # Fusions.gemv_rope_kv
            norm_args = (residual, norm.weight, norm.eps)
            q, residual = gemv_rope_kv(hidden, qkv_weight, rope, norm_args, **qkv_args)
            hidden = attention.attend_cached(q)
        else:
            qkv, residual = gemv_rms_norm(
                hidden, residual, norm.weight, norm.eps, qkv_weight, **qkv_args
            )
            hidden = attention.attend(positions, qkv)
        norm = self.post_attention_layernorm
        gate_up, gate_up_scale = gate_up_weights
        if not use_gemv(hidden, gate_up, silu_mul=True, norm=True, weight_scale=gate_up_scale):
            hidden, residual = norm(hidden, residual)
            return mlp(hidden), residual
        hidden, residual = gemv_rms_norm(
            hidden, residual, norm.weight, norm.eps, gate_up, silu_mul=True,
            weight_scale=gate_up_scale,
        )  # fmt: skip
        return mlp.down_proj(hidden), residual


class LlamaModel(DecoderStack):
    def __init__(
        self, config, max_position: int, tp: TensorParallelGroup, pp: PipelineGroup | None = None
    ):
        super().__init__()
        first, last = pp is None or pp.is_first, pp is None or pp.is_last
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp) if first else None
        )
        # one rotary table for every layer: its cos / sin rows are computed once per step
        rotary = _rotary(config, max_position)
        self.layers = stage_layers(
            config.num_hidden_layers,
            lambda i: LlamaDecoderLayer(config, max_position, tp, f"model.layers.{i}", rotary),
            None if pp is None else pp.layer_range(config.num_hidden_layers),
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None


class LlamaForCausalLM(nn.Module):
    # HF name fragment -> (fused parameter fragment, shard id)
    stacked_params = (
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    )

    def __init__(
        self,
        config,
        max_position: int | None = None,
        tp: TensorParallelGroup | None = None,
        pp: PipelineGroup | None = None,
    ):
        super().__init__()
        self.config = config
        self.pp = pp
        tp = tp or TensorParallelGroup.single()
        self.validate_tensor_parallel(config, tp.world_size)
        max_position = max_position or config.max_position_embeddings
        self.model = LlamaModel(config, max_position, tp, pp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None
        if pp is None or pp.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
            if self.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.weight = self.model.embed_tokens.weight
        # Whether the LM head shares the embedding's parameter (one stage holds both).
        self._shares_embedding = self.tie_word_embeddings and self.model.embed_tokens is not None

    @staticmethod
    def validate_tensor_parallel(config, world_size: int) -> None:
        """Raise ShardingError unless heads, KV heads and the MLP split over `world_size`.

        Called by the engine before it spawns any worker, so a bad size fails at once.
        """
        shard_range(config.num_attention_heads, 0, world_size, "num_attention_heads")
        shard_range(_num_kv_heads(config), 0, world_size, "num_key_value_heads")
        shard_range(config.intermediate_size, 0, world_size, "intermediate_size")

    @classmethod
    def family(cls, config) -> AttentionFamily:
        """Paged MHA: every feature (prefix caching, draft model, TP, PP, fp8 KV)."""
        return AttentionFamily()

    @staticmethod
    def validate_pipeline_parallel(config, num_stages: int) -> None:
        """Raise PipelineError unless every stage gets at least one decoder layer."""
        stage_layer_range(config.num_hidden_layers, 0, num_stages)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        """Hidden states [T, hidden]; on a pipeline stage other than the last, the
        (hidden, residual) the next stage takes as `intermediate`."""
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[T, vocab] logits on tensor-parallel rank 0; None on the other ranks."""
        return self.lm_head.compute_logits(hidden)

    @property
    def attention_layers(self) -> list[MHAAttention]:
        return [
            layer.self_attn.attn
            for layer in self.model.layers
            if not isinstance(layer, MissingLayer)
        ]

    @staticmethod
    def stage_holds(config, pp: PipelineGroup | None, name: str) -> bool:
        """Whether pipeline stage `pp` keeps the checkpoint tensor `name` (a rank reads
        only those: the loader skips the others without dequantizing them)."""
        if pp is None:
            return True
        if name.startswith("model.layers."):
            start, end = pp.layer_range(config.num_hidden_layers)
            return start <= int(name.split(".")[2]) < end
        if name.startswith("model.embed_tokens."):
            tied = bool(getattr(config, "tie_word_embeddings", False))
            return pp.is_first or (tied and pp.is_last)
        if name.startswith(("model.norm.", "lm_head.")):
            return pp.is_last
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused, sharded) parameters; each rank keeps only
        its part of each tensor. Every parameter must be set."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or not self.stage_holds(self.config, self.pp, name):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if name == "model.embed_tokens.weight" and self.model.embed_tokens is None:
                name = "lm_head.weight"  # a tied head on a later pipeline stage
            for hf_part, fused_part, shard in self.stacked_params:
                if f".{hf_part}." in name:
                    target = name.replace(hf_part, fused_part)
                    key = f"{target}#{shard}"
                    break
            else:
                target, shard, key = name, None, name
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            load_parameter(param, tensor, shard, name)
            loaded.add(key)
        expected = set()
        for pname in params:
            if "qkv_proj" in pname:
                expected |= {f"{pname}#{s}" for s in "qkv"}
            elif "gate_up_proj" in pname:
                expected |= {f"{pname}#0", f"{pname}#1"}
            elif not (pname == "lm_head.weight" and self._shares_embedding):
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")

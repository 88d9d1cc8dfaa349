"""AttentionFamily: the one object through which the engine learns a model's attention.

Each model class declares its family (`family(hf_config)`, a classmethod returning a
fresh object); the engine asks it, and never sniffs the model or its layers. A family owns:

- its KV spec: bytes per page-table block (`kv_block_bytes`) and the allocation of the
  paged cache with the binding of each layer's views (`allocate_kv_cache`);
- its per-sequence state contract (`state_contract`): every tensor a sequence owns that is
  not KV blocks, as `StateTensor`s (owner layer, name, shape per state slot, dtype), laid out
  by the one allocator, atom/model_engine/state_slots.py;
- the per-slot backend (`backend()`: buffer specs, stage, build_metadata, graph and verify
  graph metadata, derive_views; atom/attention/backend.py);
- what it supports (`supports`: prefix caching, the draft role in speculation, tensor and
  pipeline parallelism, fp8 KV) and how its memory rolls back under speculation
  (`speculation`).

docs/architecture.md ("Attention families") walks through adding one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.attention.backend import MHABackend, MLABackend, PagedAttentionBackend
from atom.kernels.kv_cache import FP8_DTYPE


@dataclass(frozen=True)
class FamilySupport:
    """What a family supports; a cross-cutting feature asks here, never per model type."""

    # Cached blocks can be shared by a later request with the same prefix (false where a
    # sequence's per-sequence state is not cached with its blocks).
    prefix_caching: bool = True
    # A speculative draft model of this family can share the target's block ids and be
    # rolled back by position (atom/model_engine/speculative/draft_model.py).
    draft_model: bool = False
    tensor_parallel: bool = False  # the model's own validate_tensor_parallel says why not
    # A model of this family splits over pipeline stages: its class then has
    # `validate_pipeline_parallel(hf_config, stages)` and `stage_holds(hf_config, pp, name)`.
    pipeline_parallel: bool = False
    fp8_kv: bool = False  # kv_cache_dtype="fp8"


@dataclass(frozen=True)
class StateTensor:
    """One per-sequence state tensor: `owner.<name>` is bound to ``[num_slots + 1, *shape]``
    (the last row is scratch for padded rows, state slot -1)."""

    owner: torch.nn.Module
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def layer_state(layers, cache_dtype: torch.dtype) -> list[StateTensor]:
    """The state contract of layers that describe their own state:
    ``state_specs(cache_dtype) -> {name: (shape per slot, dtype)}``."""
    return [
        StateTensor(layer, name, tuple(shape), dtype)
        for layer in layers
        for name, (shape, dtype) in layer.state_specs(cache_dtype).items()
    ]


@dataclass
class KVCache:
    data: torch.Tensor | list[torch.Tensor]  # V4 / V4.1: their entry pools
    scales: torch.Tensor | None  # fp8 only


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype for ``Config.kv_cache_dtype``: auto = the model's dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be auto or fp8, got {kv_cache_dtype!r}")


class AttentionFamily:
    """Paged multi-head attention (MHA): K and V per token, layer and kv head.

    Layout: ``data`` is ``[2 (K, V), num_layers, num_blocks, block_size, num_kv_heads,
    head_dim]``. With fp8 it holds ``torch.float8_e4m3fn`` and ``scales``, ``[2, num_layers,
    num_blocks, block_size, num_kv_heads]`` float32, sits beside it: one scale per token and
    kv head (atom/kernels/kv_cache.py says why). Each layer gets ``k_cache``/``v_cache`` and,
    for fp8, ``k_scale``/``v_scale`` (None otherwise).
    """

    name = "mha"
    backend_class: type[PagedAttentionBackend] = MHABackend
    supports = FamilySupport(
        draft_model=True, tensor_parallel=True, pipeline_parallel=True, fp8_kv=True
    )
    # How fp8 KV is refused (a family with `supports.fp8_kv` False): "... not supported for X".
    fp8_refusal = "this model"

    def __init__(self, supports: FamilySupport | None = None):
        # A model whose other parts refuse what the attention allows (Qwen3-Next without
        # GDN layers: MHA, one process) declares its own.
        if supports is not None:
            self.supports = supports

    @property
    def speculation(self):
        """How the family's memory rolls back rejected drafts (SpeculationSupport)."""
        return self.backend_class.speculation

    def backend(self) -> PagedAttentionBackend:
        """A fresh per-slot backend (each runner slot has its own)."""
        return self.backend_class()

    # -- per-sequence state ----------------------------------------------------------------
    @property
    def has_state(self) -> bool:
        """Whether a sequence owns state slots (then `state_contract` names their tensors)."""
        return False

    def num_state_slots(self, max_num_seqs: int) -> int:
        return max_num_seqs if self.has_state else 0

    def state_contract(self, model, cache_dtype: torch.dtype) -> list[StateTensor]:
        return []

    # -- the paged KV cache ----------------------------------------------------------------
    def check_cache_dtype(self, cache_dtype: torch.dtype) -> None:
        if cache_dtype == FP8_DTYPE and not self.supports.fp8_kv:
            raise ValueError(
                f"kv_cache_dtype='fp8' is not supported for {self.fp8_refusal}; use 'auto'"
            )

    def kv_block_bytes(self, model, block_size: int, cache_dtype: torch.dtype) -> int:
        """Bytes of one KV block over all layers, scales included."""
        self.check_cache_dtype(cache_dtype)
        scale_bytes = 4 if cache_dtype == FP8_DTYPE else 0
        per_token = sum(
            2 * a.num_kv_heads * (a.head_dim * cache_dtype.itemsize + scale_bytes)
            for a in model.attention_layers
        )
        return per_token * block_size

    def allocate_kv_cache(self, model, num_blocks, block_size, cache_dtype, device) -> KVCache:
        """Allocate the cache and bind each layer's views (every layer has the same shape)."""
        self.check_cache_dtype(cache_dtype)
        layers = model.attention_layers
        first = layers[0]
        shape = (first.num_kv_heads, first.head_dim)
        if any((a.num_kv_heads, a.head_dim) != shape for a in layers):
            raise ValueError("every attention layer must have the same num_kv_heads and head_dim")
        rows = (2, len(layers), num_blocks, block_size, first.num_kv_heads)
        data = torch.empty((*rows, first.head_dim), dtype=cache_dtype, device=device)
        # Rows are read only after they are written; zeroed scales just keep dumps readable.
        scales = None
        if cache_dtype == FP8_DTYPE:
            scales = torch.zeros(rows, dtype=torch.float32, device=device)
        for index, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = data[0, index], data[1, index]
            if scales is not None:
                layer.k_scale, layer.v_scale = scales[0, index], scales[1, index]
        return KVCache(data, scales)


class MLAFamily(AttentionFamily):
    """Multi-head latent attention (atom/attention/mla.py): one latent row per token and
    layer (``kv_lora_rank + rope_dim``), addressed by the MHA slots. ``data`` is
    ``[num_layers, num_blocks, block_size, latent_dim]``; each layer gets ``latent_cache``."""

    name = "mla"
    backend_class = MLABackend
    supports = FamilySupport()
    fp8_refusal = "MLA (latent cache) models"

    def kv_block_bytes(self, model, block_size: int, cache_dtype: torch.dtype) -> int:
        self.check_cache_dtype(cache_dtype)
        layers = model.attention_layers
        return sum(a.latent_dim * cache_dtype.itemsize for a in layers) * block_size

    def allocate_kv_cache(self, model, num_blocks, block_size, cache_dtype, device) -> KVCache:
        self.check_cache_dtype(cache_dtype)
        layers = model.attention_layers
        latent_dim = layers[0].latent_dim
        if any(a.latent_dim != latent_dim for a in layers):
            raise ValueError("every MLA layer must have the same kv_lora_rank + rope dim")
        data = torch.empty(
            (len(layers), num_blocks, block_size, latent_dim), dtype=cache_dtype, device=device
        )
        for index, layer in enumerate(layers):
            layer.latent_cache = data[index]
        return KVCache(data, None)

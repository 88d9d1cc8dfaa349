"""Triton kernels of atom, each beside a pure-torch reference of the same math.

On CUDA (or under ``TRITON_INTERPRET=1``, which tests use on CPU) the public functions run
the Triton kernels; the engine on CPU calls the ``*_reference`` functions directly.
"""

from atom.kernels.activation import silu_and_mul, silu_and_mul_reference
from atom.kernels.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from atom.kernels.kv_cache import store_kvcache, store_kvcache_reference
from atom.kernels.moe import fused_moe, routed_experts_reference
from atom.kernels.platform import HAS_TRITON, dot_precision, use_triton
from atom.kernels.prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from atom.kernels.rmsnorm import rms_norm, rms_norm_reference
from atom.kernels.rotary import apply_rotary, apply_rotary_reference

__all__ = [
    "HAS_TRITON",
    "dot_precision",
    "apply_rotary",
    "apply_rotary_reference",
    "fused_moe",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "rms_norm",
    "rms_norm_reference",
    "routed_experts_reference",
    "silu_and_mul",
    "silu_and_mul_reference",
    "store_kvcache",
    "store_kvcache_reference",
    "use_triton",
]

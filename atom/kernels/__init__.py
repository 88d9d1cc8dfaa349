"""Triton kernels of atom, each beside a pure-torch reference of the same math.

On CUDA (or under ``TRITON_INTERPRET=1``, which tests use on CPU) the public functions run
the Triton kernels; the engine on CPU calls the ``*_reference`` functions directly.
"""

import functools
import logging
import os

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # e.g. macOS: only the torch references are available
    HAS_TRITON = False


def use_triton(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` should go through a Triton kernel rather than a torch reference."""
    wanted = tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if wanted and not HAS_TRITON:
        _warn_no_triton()
    return wanted and HAS_TRITON


@functools.cache
def _warn_no_triton() -> None:
    logging.getLogger(__name__).warning(
        "Triton is not installed: the Triton kernels run as their torch references "
        "(slower on CUDA); install it with `pip install triton`"
    )


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input precision for operands of ``dtype``: "ieee" for fp32 (a GPU's
    default rounds fp32 operands to TF32, ~1e-3 relative: enough to flip greedy near-ties
    against an fp32 reference), "tf32" otherwise (ignored for 16-bit operands)."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Imported after use_triton: the kernel modules import it from here.
from atom.kernels.activation import silu_and_mul, silu_and_mul_reference  # noqa: E402
from atom.kernels.decode_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_reference,
)
from atom.kernels.kv_cache import store_kvcache, store_kvcache_reference  # noqa: E402
from atom.kernels.moe import fused_moe, routed_experts_reference  # noqa: E402
from atom.kernels.prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from atom.kernels.rmsnorm import rms_norm, rms_norm_reference  # noqa: E402
from atom.kernels.rotary import apply_rotary, apply_rotary_reference  # noqa: E402

__all__ = [
    "HAS_TRITON",
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

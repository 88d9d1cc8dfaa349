"""Whether a tensor goes through a Triton kernel or its torch reference, and the dot precision.

Its own module (not the package's __init__) so that kernel modules import it without an
import circle through the package, which re-exports every public kernel.
"""

import functools
import logging
import os

import torch

from atom import envs

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


def use_cuda_path(tensor: torch.Tensor) -> bool:
    """True where a model takes its CUDA path (fused Triton kernels) rather than the torch
    references: on CUDA, and on CPU under the interpreter when ``ATOM_INTERPRET_CUDA_PATH=1``
    (tests and the kernel map run the CUDA path's kernels there, slowly). Plain CPU keeps the
    references, faster there than interpreted kernels."""
    if tensor.is_cuda:
        return True
    return (
        HAS_TRITON
        and os.environ.get("TRITON_INTERPRET") == "1"
        and envs.interpret_cuda_path()
    )

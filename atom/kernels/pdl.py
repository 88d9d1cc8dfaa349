"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (``Fusions.pdl``).

A kernel launched with PDL may start while the kernel before it on the stream still runs:
its programs are scheduled, run their prologue and wait in ``gdc_wait`` until the previous
grid has finished and its memory is visible. What that hides is the launch and ramp-up of
each kernel, about a microsecond, and whatever the prologue loads: worth it where a decode
step is a chain of short kernels (a small model at batch 1), a loss where a memory-bound
kernel needs every SM slot that the waiting programs of the next one hold (figures in
docs/benchmarks.md).

Each participating kernel takes a ``PDL`` constexpr and calls ``pdl_wait_and_release(PDL)``
before its first access to anything an earlier kernel of the forward writes: it lets the
next kernel launch, then waits for the previous one. Before the wait a kernel reads only
what no kernel of the forward writes: the weights (the one-row GEMV loads its first
weight chunk there), the step's metadata, published before the forward's first kernel
(paged decode loads its context length and first block ids there), and the KV cache of
earlier steps (paged decode's first tile, in layers marked ``early_kv``; this step's token
is written by the kernel before, so it is loaded after the wait). Since a PDL kernel may start as soon
as the one before it has started, a chain of PDL kernels can run alongside each other back
to the last kernel without PDL, which has finished; each still waits, so the chain's data
stays ordered. The host side, ``pdl_launch(tensor, weight_bytes)``, gives the constexpr and
the launch option: on when the forward context's fusions say so, the tensor is on a CUDA
device that supports it (``pdl_supported``: Hopper or newer, never under the interpreter)
and, for a GEMV, its weight is small enough to be bound by latency (PDL_GEMV_BYTES:
a geometry, so one compiled variant per layer shape).
A CUDA graph keeps the launch attributes it was captured with.

Two knobs for measurement (`python -m benchmarks.decode_ab`), read once with the fusions
(``Fusions.pdl_kernels`` and ``pdl_release``, from ATOM_PDL_KERNELS and ATOM_PDL_RELEASE):
small (no GEMV) | all (every GEMV) | latency (the default); end has a GEMV let the next
kernel launch only after its K loop. The defaults won on every shape measured.

Triton: ``launch_pdl`` and ``tl.extra.cuda.gdc_*`` are used only when PDL is on; off, the
kernels compile as before.
"""

from __future__ import annotations

import os

import torch

from atom.forward_context import current_fusions

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: keep the module importable
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)

_OFF: tuple[int, dict] = (0, {})


_SUPPORTED: dict[torch.device, bool] = {}


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on this CUDA device can use PDL: an NVIDIA GPU of compute
    capability 9.0 or newer (Hopper) and a Triton with the ``gdc_*`` intrinsics and the
    ``launch_pdl`` launch option."""
    if device not in _SUPPORTED:
        cuda = getattr(getattr(tl, "extra", None), "cuda", None)
        try:
            from triton.backends.nvidia.compiler import CUDAOptions

            has_option = "launch_pdl" in CUDAOptions.__dataclass_fields__
        except (ImportError, AttributeError):
            has_option = False
        _SUPPORTED[device] = (
            torch.version.hip is None
            and has_option
            and hasattr(cuda, "gdc_wait")
            and hasattr(cuda, "gdc_launch_dependents")
            and torch.cuda.get_device_capability(device)[0] >= 9
        )
    return _SUPPORTED[device]


# A GEMV reading fewer weight bytes than this is bound by latency, not bandwidth (4 MB
# stream in about a microsecond on an HBM3 GPU, about a launch): paged decode after a qkv
# projection this small loads cached K / V before its wait (``latency_bound``).
LATENCY_BOUND_BYTES = 4 << 20
# A Triton GEMV of up to this many weight bytes joins the PDL chain by default: about two
# microseconds of streaming on an HBM3e GPU, so its launch and ramp-up, hidden behind the
# kernel before it, are a large share (the 1B shape's o projection, 8.4 MB: +1.6% at
# batch 1 against 4 MB, docs/benchmarks.md); past it, programs waiting under PDL would
# hold SM slots a bandwidth-bound kernel before them needs.
PDL_GEMV_BYTES = 10 << 20


def latency_bound(weight: torch.Tensor) -> bool:
    """Whether a one-row GEMV over ``weight`` is bound by latency (LATENCY_BOUND_BYTES):
    paged decode after a qkv projection of that size loads cached K / V before its wait
    (``paged_decode_attention(early_kv=...)``). Which GEMVs join the PDL chain is
    PDL_GEMV_BYTES, a larger size."""
    return weight.numel() * weight.element_size() <= LATENCY_BOUND_BYTES


def pdl_launch(tensor: torch.Tensor, weight_bytes: int = 0) -> tuple[int, dict]:
    """(the PDL constexpr, extra launch options) for a kernel launched on ``tensor``'s
    device in the current forward context. Never decided by a runtime length (the rows of
    a step): the PDL constexpr would then compile a second variant. ``weight_bytes``: what
    a GEMV reads of its weight (0 for the kernels of few programs: attention, merge,
    norm). The constexpr: 0 off, 1 the next kernel may launch at once, 2 after a GEMV's K
    loop, EMULATED (tests only: the PDL code paths without the launch intrinsics, which the
    Triton interpreter lacks). Measurement knobs (the forward's fusions): ``pdl_kernels``
    latency (default: the small kernels and the GEMVs up to PDL_GEMV_BYTES) | small
    (no GEMV) | all; ``pdl_release`` start | end (when a GEMV lets the next kernel launch)."""
    if not tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return _OFF
    fusions = current_fusions()
    if not fusions.pdl or not pdl_supported(tensor.device):
        return _OFF
    if weight_bytes:
        kernels = fusions.pdl_kernels
        if kernels == "small" or (kernels != "all" and weight_bytes > PDL_GEMV_BYTES):
            return _OFF
    # a small kernel lets the next one launch at once (its programs leave room); a GEMV
    # at its start (mode 1) or after its K loop (mode 2)
    late = weight_bytes and fusions.pdl_release == "end"
    return 2 if late else 1, {"launch_pdl": True}


EMULATED = 3  # the kernels' PDL code paths (loads before the wait), no intrinsics: tests

# The decode chain's small kernels of the MoE and GDN layers (routing, the k-sum, the GDN
# split, conv, delta rule and gated norm) join PDL as the norms and paged decode do; False:
# they launch without it (benchmarks' `--pdl-chain on off`).
CHAIN = True


def pdl_chain_launch(tensor: torch.Tensor) -> tuple[int, dict]:
    """``pdl_launch`` for a small kernel of the MoE / GDN decode chain (``CHAIN``)."""
    return pdl_launch(tensor) if CHAIN else _OFF


@triton.jit
def pdl_wait_and_release(PDL: tl.constexpr):
    """With PDL: let the next kernel launch (mode 1; mode 2 at ``pdl_release``), then
    wait for the previous one to finish."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL == 1 or PDL == 2:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Mode 2: let the next kernel launch once this program's main work is done."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()

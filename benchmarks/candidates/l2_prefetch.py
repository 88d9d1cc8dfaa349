"""Prefetch a weight into the GPU's L2 cache ahead of the kernel that reads it (a candidate
that lost: on the H200 every placement slowed the batch-1 chain of benchmarks/l2_prefetch.py
by 2-22%, docs/benchmarks.md; kept here to measure against).

A batch-1 decode step is a chain of kernels, most of them one-row GEMVs bound by reading
their weight once. Between them the HBM idles: while paged attention, a norm or a GEMV's
ramp-up and tail run, no weight streams. ``l2_prefetch(weight)`` launches a kernel whose
programs issue Hopper bulk L2 prefetches (``cp.async.bulk.prefetch.L2``, fire and forget:
the program exits as soon as the requests are issued) for the weight's bytes, so a later
GEMV reads it from L2 instead of HBM while the idle time streams it.

The kernel writes nothing and reads nothing a forward writes: under PDL (atom/kernels/pdl.py)
it issues its prefetches before it waits for the kernel before it (and it waits, so the
chain's ordering holds). Without Hopper (compute capability < 9), on ROCm or under the
interpreter it is not launched: a prefetch changes no result.

Geometry: CHUNK bytes per bulk request (a multiple of 16), PER_PROGRAM requests per program;
the byte count is a plain argument (one compiled variant for every weight size).
"""

from __future__ import annotations

import os

import torch

from atom.kernels.pdl import pdl_launch, pdl_wait_and_release

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: keep the module importable
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)

CHUNK = 16384  # bytes per bulk prefetch request
PER_PROGRAM = 32  # requests per program (one per lane of a warp)


@triton.jit
def _l2_prefetch_kernel(
    base_ptr,  # uint8 view of the weight
    num_bytes,
    sink_ptr,  # int32 [1]: never written (keeps the requests' results alive)
    CHUNK: tl.constexpr,
    PER_PROGRAM: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = (pid * PER_PROGRAM + tl.arange(0, PER_PROGRAM).to(tl.int64)) * CHUNK
    size = tl.minimum(num_bytes - offs, CHUNK)
    size = tl.where(offs < num_bytes, size - size % 16, 0).to(tl.int32)
    # a request of `size` bytes where size > 0; the register result is a dummy
    issued = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base_ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip
    tl.store(sink_ptr + tl.arange(0, PER_PROGRAM), issued, mask=issued != 0)
    pdl_wait_and_release(PDL)


_SUPPORTED: dict[torch.device, bool] = {}
_SINKS: dict[torch.device, torch.Tensor] = {}


def l2_prefetch_supported(device: torch.device) -> bool:
    """Hopper or newer NVIDIA GPU (the bulk prefetch is sm_90), not the interpreter."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if device not in _SUPPORTED:
        _SUPPORTED[device] = (
            torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9
        )
    return _SUPPORTED[device]


def prefetch_programs(num_bytes: int, chunk: int = CHUNK, per_program: int = PER_PROGRAM) -> int:
    """Programs that cover ``num_bytes`` in ``chunk``-byte requests, ``per_program`` each."""
    return max(1, -(-num_bytes // (chunk * per_program)))


def l2_prefetch(weight: torch.Tensor, max_bytes: int | None = None) -> bool:
    """Ask L2 for ``weight``'s first ``max_bytes`` bytes (all by default); returns whether a
    kernel was launched. ``weight`` must be contiguous."""
    if not l2_prefetch_supported(weight.device):
        return False
    assert weight.is_contiguous(), "a contiguous weight"
    flat = weight.view(-1).view(torch.uint8)
    num_bytes = flat.numel() if max_bytes is None else min(flat.numel(), max_bytes)
    if weight.device not in _SINKS:
        _SINKS[weight.device] = torch.zeros(PER_PROGRAM, dtype=torch.int32, device=weight.device)
    pdl, launch = pdl_launch(weight)
    _l2_prefetch_kernel[(prefetch_programs(num_bytes),)](
        flat, num_bytes, _SINKS[weight.device], CHUNK=CHUNK, PER_PROGRAM=PER_PROGRAM, PDL=pdl,
        num_warps=1, **launch,
    )  # fmt: skip
    return True

"""Freed CPU activations stay in the process's heap (glibc malloc), instead of going back
to the kernel and returning, as fresh zeroed pages, at the next step.

glibc serves an allocation above its mmap threshold (128 KiB, adapting) with a fresh mmap
and unmaps it on free, and trims the heap's free top above twice that threshold; a
prefill's activations (SmolLM2, 4096 tokens: 19-31 MB hidden / rotary / qkv outputs per
layer) went that way, so every step faulted in and zeroed its memory again: 480-560k page
faults and 1.3-1.6 s of kernel time in a 15 s prefill of 32 128-token prompts; 46-81k
and 0.12-0.16 s with the settings here (docs/benchmarks.md, CPU section).
vLLM's CPU backend gets the same effect by preloading tcmalloc.

`keep_freed_memory_in_heap` raises the mmap threshold to glibc's largest (32 MiB: larger
blocks still come from mmap) and lets the heap keep up to `TRIM_THRESHOLD_BYTES` of free
memory at its top (glibc's default trims above twice the threshold, so a step's blocks
of varied sizes went back and forth). The resident memory after a prefill stayed what it
was (2.0-2.2 GB for SmolLM2 either way); the page faults fell 10x. It changes nothing but
where bytes live. `ATOM_CPU_MALLOC=system` leaves malloc as it is; so does a C library
other than glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 512 << 20

_applied = False


def keep_freed_memory_in_heap() -> bool:
    """Set glibc's malloc to keep freed blocks in the heap, once per process; True where
    glibc took the settings."""
    global _applied
    if _applied:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: its own policy stays
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    ):
        logger.warning("CPU engine: glibc refused the malloc settings; the default stays")
        return False
    _applied = True
    return True

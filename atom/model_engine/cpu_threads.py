"""How many threads a single-process engine on CPU computes with.

torch's default (one OpenMP thread per core) is the fastest on an idle machine, and by far
the slowest on a busy one: every op ends at an OpenMP barrier, and a barrier waits for the
thread the kernel descheduled in favour of another process. On the shared 2-core
development machine (load average 5) a SmolLM2 decode step at batch 16 took 5.1 s with 2
threads and 0.44 s with 1 (docs/benchmarks.md, "CPU beside vLLM"). vLLM's CPU backend
avoids the same trap by binding one thread per core it keeps and reserving one core for
its front end; atom runs the host work on the computing thread (a CPU step is
synchronous), so it keeps every core that is free when the engine starts.

An explicit OMP_NUM_THREADS (or ATOM_CPU_THREADS) wins over the guess.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def choose_cpu_threads(explicit: int | None) -> int:
    """The thread count for this process's torch ops: `explicit` (Config.cpu_threads:
    ATOM_CPU_THREADS, else OMP_NUM_THREADS, which torch already follows), else the cores
    not busy with other processes (usable cores minus the 1-minute load average, at
    least 1)."""
    if explicit is not None:
        return explicit
    cores = usable_cores()
    try:
        busy = round(os.getloadavg()[0])
    except OSError:
        busy = 0
    return max(1, min(cores, cores - busy))


def set_cpu_threads(explicit: int | None) -> int:
    threads = choose_cpu_threads(explicit)
    if threads != torch.get_num_threads():
        logger.info("CPU engine: %d torch thread(s) (of %d cores)", threads, usable_cores())
        torch.set_num_threads(threads)
    return threads

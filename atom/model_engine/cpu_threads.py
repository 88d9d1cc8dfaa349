"""How many threads a single-process engine on CPU computes with.

torch's default (one OpenMP thread per core) is the fastest on an idle machine, and by far
the slowest on a busy one: every op ends at an OpenMP barrier, and a barrier waits for the
thread the kernel descheduled in favour of another process. On the shared 2-core
development machine (load average 5) a SmolLM2 decode step at batch 16 took 5.1 s with 2
threads and 0.44 s with 1 (docs/benchmarks.md, "CPU beside vLLM"). vLLM's CPU backend
avoids the same trap by binding one thread per core it keeps and reserving one core for
its front end; atom runs the host work on the computing thread (a CPU step is
synchronous), so it keeps every core that is free when the engine starts.

"Free" is measured, not averaged: the other processes' CPU time over a short window at
start (`/proc/stat` less this process's own time), where the 1-minute load average both
lags behind a process that just ended and counts one that is blocked. On the idle 2-core
development machine, right after another engine process had exited (load average 1.4,
no other process running), the average gave 1 thread; 2 ran the embedded SmolLM2's
`generate` 1.57x faster at batch 16 and 1.66x at 64 (docs/benchmarks.md, "CPU beside
vLLM"). Where `/proc/stat` cannot be read (not Linux), the load average is the guess.

An explicit OMP_NUM_THREADS (or ATOM_CPU_THREADS) wins over the guess.
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


SAMPLE_SECONDS = 0.25  # the window over which other processes' CPU time is measured


def _cpu_ticks() -> tuple[int, int, int]:
    """(busy ticks of all CPUs, all ticks, CPUs) from /proc/stat's first lines; busy counts
    user, nice, system, irq, softirq and steal (time the hypervisor gave elsewhere)."""
    with open("/proc/stat") as stat:
        lines = stat.read().splitlines()
    fields = [int(v) for v in lines[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    busy = user + nice + system + irq + softirq + steal
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return busy, busy + idle + iowait, max(1, cpus)


def _own_ticks() -> float:
    times = os.times()
    return (times.user + times.system) * os.sysconf("SC_CLK_TCK")


def busy_cores(seconds: float = SAMPLE_SECONDS) -> float:
    """Cores the other processes kept busy over the next `seconds` (this process's own
    CPU time taken out); the 1-minute load average where /proc/stat cannot be read."""
    try:
        busy0, total0, cpus = _cpu_ticks()
        own0 = _own_ticks()
        time.sleep(seconds)
        busy1, total1, _ = _cpu_ticks()
        own1 = _own_ticks()
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except OSError:
            return 0.0
    elapsed = (total1 - total0) / cpus  # ticks of one CPU over the window
    if elapsed <= 0:
        return 0.0
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / elapsed


def choose_cpu_threads(explicit: int | None) -> int:
    """The thread count for this process's torch ops: `explicit` (Config.cpu_threads:
    ATOM_CPU_THREADS, else OMP_NUM_THREADS, which torch already follows), else the cores
    the other processes leave free now (usable cores minus `busy_cores`, rounded, at
    least 1)."""
    if explicit is not None:
        return explicit
    cores = usable_cores()
    return max(1, min(cores, cores - round(busy_cores())))


def set_cpu_threads(explicit: int | None) -> int:
    threads = choose_cpu_threads(explicit)
    if threads != torch.get_num_threads():
        logger.info("CPU engine: %d torch thread(s) (of %d cores)", threads, usable_cores())
        torch.set_num_threads(threads)
    return threads

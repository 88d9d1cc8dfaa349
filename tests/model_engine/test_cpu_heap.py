"""A CPU engine keeps freed activations in glibc's heap (atom/model_engine/cpu_heap.py): a
block freed and asked for again is not faulted in again; ATOM_CPU_MALLOC picks the mode."""

import subprocess
import sys
import textwrap

import pytest

from atom import envs

# In a process of its own (malloc settings are per process): page faults of the sixth
# round of filling 12, 20 and 28 MB tensors, each freed at once, with the setting.
FAULTS = textwrap.dedent(
    """
    import resource, sys, torch
    from atom.model_engine.cpu_heap import keep_freed_memory_in_heap

    applied = keep_freed_memory_in_heap() if sys.argv[1] == "heap" else False
    faults = []
    for _ in range(6):  # five rounds to warm up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for size in (3 << 20, 5 << 20, 7 << 20):
            torch.empty(size).fill_(1.0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(applied, faults[-1])
    """
)


def _last_round_faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", FAULTS, mode], check=True, capture_output=True, text=True
    ).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_blocks_are_not_faulted_in_again():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc: Linux only")
    applied, heap = _last_round_faults("heap")
    if not applied:
        pytest.skip("not glibc: malloc keeps its own policy")
    pages = (15 << 22) // 4096  # 60 MB filled per round
    # (glibc's default faulted 5-7k pages in that round here, varying between processes)
    assert heap < pages // 10  # kept in the heap: no fault for most of their pages


def test_cpu_malloc_mode(monkeypatch):
    monkeypatch.delenv("ATOM_CPU_MALLOC", raising=False)
    assert envs.cpu_malloc() == "heap"
    monkeypatch.setenv("ATOM_CPU_MALLOC", "System")
    assert envs.cpu_malloc() == "system"
    monkeypatch.setenv("ATOM_CPU_MALLOC", "tcmalloc")
    with pytest.raises(ValueError, match="ATOM_CPU_MALLOC"):
        envs.cpu_malloc()

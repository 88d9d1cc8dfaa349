"""The CPU engine's torch thread count (atom/model_engine/cpu_threads.py): an explicit
count (Config.cpu_threads: ATOM_CPU_THREADS, else OMP_NUM_THREADS) wins; otherwise the
cores the other processes leave free at start, measured over a short window."""

import subprocess
import sys

import pytest

from atom import envs
from atom.config import Config
from atom.model_engine import cpu_threads


@pytest.fixture
def no_thread_env(monkeypatch):
    monkeypatch.delenv("ATOM_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return monkeypatch


def test_an_explicit_count_wins(no_thread_env):
    assert envs.cpu_threads() is None
    no_thread_env.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads.choose_cpu_threads(envs.cpu_threads()) == 2
    no_thread_env.setenv("ATOM_CPU_THREADS", "3")  # before OMP_NUM_THREADS
    assert Config(device="cpu").cpu_threads == 3
    assert cpu_threads.choose_cpu_threads(envs.cpu_threads()) == 3
    no_thread_env.setenv("ATOM_CPU_THREADS", "0")
    assert cpu_threads.choose_cpu_threads(envs.cpu_threads()) == 1
    no_thread_env.setenv("ATOM_CPU_THREADS", "many")
    with pytest.raises(ValueError, match="ATOM_CPU_THREADS"):
        Config(device="cpu")
    assert Config(device="cpu", cpu_threads=5).cpu_threads == 5  # the field wins
    with pytest.raises(ValueError, match="cpu_threads"):
        Config(device="cpu", cpu_threads=0)


@pytest.mark.parametrize("busy, expected", [(0.0, 4), (0.4, 4), (1.4, 3), (2.6, 1), (9.0, 1)])
def test_the_cores_free_at_start(no_thread_env, busy, expected):
    no_thread_env.setattr(cpu_threads, "usable_cores", lambda: 4)
    no_thread_env.setattr(cpu_threads, "busy_cores", lambda: busy)
    assert cpu_threads.choose_cpu_threads(None) == expected


def test_busy_cores_are_the_other_processes_ticks(monkeypatch):
    """Over the window: 150 busy ticks of 2 CPUs x 100, of which this process's own 50:
    the others kept one core busy (the hand count), whatever the load average says."""
    ticks = iter([(1000, 5000, 2), (1150, 5200, 2)])
    own = iter([300.0, 350.0])
    monkeypatch.setattr(cpu_threads, "_cpu_ticks", lambda: next(ticks))
    monkeypatch.setattr(cpu_threads, "_own_ticks", lambda: next(own))
    monkeypatch.setattr(cpu_threads.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (7.0, 7.0, 7.0))
    assert cpu_threads.busy_cores() == pytest.approx(1.0)


def test_busy_cores_fall_back_to_the_load_average(monkeypatch):
    def unreadable():
        raise OSError("no /proc/stat")

    monkeypatch.setattr(cpu_threads, "_cpu_ticks", unreadable)
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (1.7, 0.0, 0.0))
    assert cpu_threads.busy_cores() == 1.7


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_a_spinning_process_counts_as_one_busy_core():
    """A real process spinning beside the test: about one core busy (this process's own
    time is left out)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = cpu_threads.busy_cores(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert 0.6 <= busy <= 2.0

"""The CPU engine's torch thread count (atom/model_engine/cpu_threads.py): an explicit
count (Config.cpu_threads: ATOM_CPU_THREADS, else OMP_NUM_THREADS) wins; otherwise the
cores not busy at start."""

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


@pytest.mark.parametrize("load, expected", [(0.0, 4), (1.4, 3), (2.6, 1), (9.0, 1)])
def test_the_cores_free_at_start(no_thread_env, load, expected):
    no_thread_env.setattr(cpu_threads, "usable_cores", lambda: 4)
    no_thread_env.setattr(cpu_threads.os, "getloadavg", lambda: (load, 0.0, 0.0))
    assert cpu_threads.choose_cpu_threads(None) == expected

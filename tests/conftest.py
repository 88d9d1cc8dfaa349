"""Shared pytest setup: Triton's interpreter on CPU-only machines, `gpu` tests skipped there."""

import os

import pytest
import torch

# Publication checks in full (per buffer) in every test; production mode is tested explicitly.
os.environ.setdefault("ATOM_H2D_CHECKED", "1")
# A CPU engine takes its thread count from the load at start (atom/model_engine/cpu_threads.py);
# the tests pin it, so a run's rounding never depends on the machine's load: to one thread
# (tiny models: a second OpenMP thread only adds a barrier per op, and on a loaded 2-core host
# a barrier waits for a descheduled thread, 10-80x slower per op), or to OMP_NUM_THREADS /
# ATOM_CPU_THREADS where the caller sets them. The tests' own torch (HF references) likewise.
os.environ.setdefault("ATOM_CPU_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
torch.set_num_threads(int(os.environ["ATOM_CPU_THREADS"]))

if not torch.cuda.is_available():
    # Must happen before any Triton kernel is defined: triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Engine fixtures (tiny random models, the block-leak check) live in tests/engine_support.py.
from tests.engine_support import (  # noqa: E402,F401
    no_leaked_blocks,
    one_cpu_thread,
    smollm2_llm,
    smollm2_tokenizer_dir,
    tiny_model_dirs,
)

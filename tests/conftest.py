"""Shared pytest setup: Triton's interpreter on CPU-only machines, `gpu` tests skipped there."""

import os

import pytest
import torch

# Publication checks in full (per buffer) in every test; production mode is tested explicitly.
os.environ.setdefault("ATOM_H2D_CHECKED", "1")
# A CPU engine takes its thread count from the load at start (atom/model_engine/cpu_threads.py);
# the tests pin it to torch's default, so a run's rounding never depends on the machine's load.
os.environ.setdefault("ATOM_CPU_THREADS", str(torch.get_num_threads()))

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

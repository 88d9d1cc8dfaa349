"""schemathesis fuzzes every operation of the server's OpenAPI schema (issue 29): whatever
it sends, the answer is never a server error (5xx).

Bounded in time: a fixed number of examples per operation (derandomized, so a run is
repeatable), against a server whose caps keep one generated request cheap (2 prompts,
4 samples, a 64-token context).
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

from atom.entrypoints.request_limits import ServerLimits  # noqa: E402
from tests.engine_support import build_llm  # noqa: E402
from tests.entrypoints.server_support import MODEL, run_server  # noqa: E402

MAX_EXAMPLES = 25  # per operation and generation mode (valid, invalid)


@pytest.fixture(scope="module")
def server(model_dir):
    # Named `server`: the conftest then waits for it to be idle after each operation.
    limits = ServerLimits(
        max_prompts_per_request=2, max_samples_per_request=4, max_queued_samples=16
    )
    server, stop = run_server(build_llm(model_dir, max_model_len=64), MODEL, limits=limits)
    yield server
    stop()


def test_no_server_errors(server):
    """Every operation, valid and invalid bodies: never a 5xx."""
    # schemathesis's pytest plugin (schema.parametrize with a fixture) breaks on pytest 9,
    # so each operation's case strategy is driven by hypothesis here directly.
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=MAX_EXAMPLES,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def fuzz(case):
                case.call_and_validate(base_url=server.url, checks=[not_a_server_error], timeout=60)

            try:
                fuzz()
            except Unsatisfiable:
                # No invalid input exists for an operation without parameters or body.
                assert mode is GenerationMode.NEGATIVE, operation.path
            server.wait_idle()

"""The test suite's set-up (tests/conftest.py) for the benchmarks' own tests: Triton's
interpreter on CPU-only machines, `gpu` tests skipped there, the engine fixtures."""

from tests.conftest import *  # noqa: F403

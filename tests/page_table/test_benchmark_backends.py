"""The page-table and h2d benchmarks run with every attention backend (same machinery)."""

import pytest
import torch

from atom.benchmarks import page_table as page_table_benchmark


@pytest.mark.parametrize("backend", ["mha", "mla", "v4", "v41"])
def test_page_table_benchmark_with_backend(backend, capsys):
    host_us, nbytes = page_table_benchmark.measure_atom(
        "one_append", 4, 128, torch.device("cpu"), 8, backend
    )
    assert host_us > 0 and nbytes > 0


@pytest.mark.parametrize("backend", ["v4", "v41"])
def test_page_table_benchmark_v4_unchanged_step_sends_nothing(backend):
    _, nbytes = page_table_benchmark.measure_atom(
        "unchanged", 4, 128, torch.device("cpu"), 8, backend
    )
    assert nbytes == 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mha", "mla", "v4", "v41"])
def test_h2d_benchmark_with_backend(backend):
    from atom.benchmarks import h2d_publication

    record = h2d_publication.measure("packed", 8, 10, attention=backend)
    assert record["attention_backend"] == backend
    assert record["copies_per_step"] > 0

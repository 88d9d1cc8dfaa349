"""The page-table and h2d benchmarks run with every attention backend (same machinery)."""

import pytest
import torch

from benchmarks import page_table as page_table_benchmark


@pytest.mark.parametrize("backend", ["mha", "mla", "v4", "v41"])
@pytest.mark.parametrize("batch", [4, 64])
def test_page_table_benchmark_sends_the_bytes_it_claims(backend, batch):
    """docs/benchmarks.md: an unchanged table sends 0 bytes; one row's appended block 24
    bytes whatever B (int32: a 5-entry delta header and the block id); a block appended
    to every row 16 bytes a row (position, start, offset, id) plus 8; either backend."""

    def nbytes(case):
        host_us, sent = page_table_benchmark.measure_atom(
            case, batch, 128, torch.device("cpu"), 8, backend
        )
        assert host_us > 0
        return sent

    assert nbytes("unchanged") == 0
    assert nbytes("one_append") == 24
    assert nbytes("all_append") == 16 * batch + 8


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mha", "mla", "v4", "v41"])
def test_h2d_benchmark_with_backend(backend):
    from benchmarks import h2d_publication

    record = h2d_publication.measure("packed", 8, 10, attention=backend)
    assert record["attention_backend"] == backend
    assert record["copies_per_step"] > 0

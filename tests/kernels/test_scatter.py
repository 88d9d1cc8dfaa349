"""The packed-publication scatter kernel against its reference."""

import numpy as np
import pytest
import torch

from atom.kernels.scatter import scatter_segments, scatter_segments_reference


def _case(device):
    rng = np.random.default_rng(0)
    src = torch.tensor(rng.integers(0, 255, 20_000), dtype=torch.uint8, device=device)
    sizes = [1, 7, 64, 2048, 2049, 5000]
    descriptors, src_off, dst_off = [], 256, 0
    for n in sizes:
        descriptors.append((src_off, dst_off, n))
        src_off += -(-n // 64) * 64
        dst_off += -(-n // 64) * 64 + 64
    return src, torch.tensor(descriptors, dtype=torch.int64, device=device), dst_off, max(sizes)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_scatter_matches_reference(device):
    src, descriptors, dst_bytes, max_bytes = _case(device)
    expected = torch.zeros(dst_bytes, dtype=torch.uint8, device=device)
    got = torch.zeros_like(expected)
    scatter_segments_reference(src, expected, descriptors, len(descriptors), max_bytes)
    scatter_segments(src, got, descriptors, len(descriptors), max_bytes)
    assert torch.equal(got, expected)
    assert expected.count_nonzero() > 0

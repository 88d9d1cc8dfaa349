"""The packed-publication scatter kernel against its reference."""

import numpy as np
import pytest
import torch

from atom.kernels.scatter import (
    HEADER_WORDS,
    fill_placeholders,
    scatter_segments,
    scatter_segments_reference,
)


def _case(device, num_segments: int, max_segments: int):
    """A source arena whose header lists segments of awkward sizes (words, not bytes)."""
    rng = np.random.default_rng(0)
    src = torch.tensor(rng.integers(1, 255, 40_000), dtype=torch.uint8)
    sizes = [4, 8, 64, 2048, 2052, 9000, 12][:num_segments]
    rows, src_off, dst_off = [], 512, 0
    for n in sizes:
        rows.append((src_off, dst_off, n))
        src_off += -(-n // 64) * 64
        dst_off += -(-n // 64) * 64 + 64
    header = np.zeros(HEADER_WORDS + 3 * max_segments, dtype=np.int64)
    header[0] = len(rows)
    # stale rows past the count (an earlier, larger step) must be ignored
    header[HEADER_WORDS:] = 64
    header[HEADER_WORDS : HEADER_WORDS + 3 * len(rows)] = np.asarray(rows).reshape(-1)
    src[: header.nbytes] = torch.from_numpy(header.view(np.uint8))
    return src.to(device), dst_off + 4096


@pytest.mark.parametrize("num_segments", [0, 1, 7])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_scatter_matches_reference(device, num_segments):
    src, dst_bytes = _case(device, num_segments, max_segments=8)
    expected = torch.zeros(dst_bytes, dtype=torch.uint8, device=device)
    got = torch.zeros_like(expected)
    scatter_segments_reference(src, expected)
    scatter_segments(src, got, max_segments=8)
    assert torch.equal(got, expected)
    assert (expected.count_nonzero() > 0) == (num_segments > 0)


@pytest.mark.parametrize("num", [1, 5, 300])  # 300: two programs of FILL_BLOCK
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fill_placeholders_writes_each_sampled_token_to_its_row(monkeypatch, device, num):
    """input_ids[dst] = tokens[src], rows permuted and sparse, against a hand-built loop;
    on CPU through the Triton interpreter."""
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    generator = torch.Generator().manual_seed(num)
    ids = torch.full((2 * num + 3,), -7, dtype=torch.int64)
    dst = torch.randperm(2 * num + 3, generator=generator)[:num].to(torch.int32)
    src = torch.randint(0, num, (num,), generator=generator).to(torch.int32)
    tokens = torch.randint(0, 50_000, (num,), generator=generator)
    expected = ids.clone()
    for d, s in zip(dst.tolist(), src.tolist(), strict=True):
        expected[d] = tokens[s]
    ids = ids.to(device)
    fill_placeholders(ids, dst.to(device), src.to(device), tokens.to(device))
    assert torch.equal(ids.cpu(), expected)

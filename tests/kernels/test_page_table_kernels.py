"""Page-table kernels (row deltas, row moves, slot mapping) against their references."""

import numpy as np
import pytest
import torch

from atom.kernels.page_table import (
    apply_row_deltas,
    apply_row_deltas_reference,
    derive_slot_mapping,
    derive_slot_mapping_reference,
    move_rows,
    move_rows_reference,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_row_deltas_match_reference(device):
    rng = np.random.default_rng(0)
    rows = torch.tensor(rng.integers(0, 1000, (6, 700)), dtype=torch.int32, device=device)
    deltas = [(0, 0, 700), (3, 5, 1), (5, 299, 300), (2, 650, 50)]  # (row, start, count)
    counts = [c for *_, c in deltas]
    packed = _i32(
        [len(deltas)]
        + [d[0] for d in deltas]
        + [d[1] for d in deltas]
        + [0, *np.cumsum(counts)]
        + list(rng.integers(1000, 2000, sum(counts))),
        device,
    )
    expected, got = rows.clone(), rows.clone()
    apply_row_deltas_reference(expected, packed, max_deltas=6)
    apply_row_deltas(got, packed, max_deltas=6)  # 6 programs for 4 deltas: 2 idle
    assert torch.equal(got, expected) and not torch.equal(got, rows)


@pytest.mark.parametrize("device", DEVICES)
def test_row_moves_match_reference_including_cycles(device):
    rng = np.random.default_rng(1)
    rows = torch.tensor(rng.integers(0, 1000, (6, 600)), dtype=torch.int32, device=device)
    # a 3-cycle (0 -> 1 -> 2 -> 0) and a move into a freed row (5 -> 4)
    sources, destinations, lengths = [0, 1, 2, 5], [1, 2, 0, 4], [600, 3, 257, 1]
    moves = _i32([4] + sources + destinations + lengths + [0] * 6, device)
    expected, got = rows.clone(), rows.clone()
    move_rows_reference(expected, torch.zeros_like(rows), moves, max_moves=6)
    move_rows(got, torch.zeros_like(rows), moves, max_moves=6)
    assert torch.equal(got, expected)
    assert torch.equal(got[1, :600], rows[0]) and torch.equal(got[0, :3], rows[2, :3])
    assert torch.equal(got[0, 300:], rows[0, 300:])  # past the moved length: untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_slot_mapping_matches_reference(device, mode):
    block_size = 16
    rows = torch.arange(4 * 40, dtype=torch.int32, device=device).view(4, 40) * 3
    if mode == "decode":  # 3 real rows padded to 5 (CUDA-graph batch: context length 0)
        positions = torch.tensor([0, 17, 600, 0, 0], device=device)
        context_lens = _i32([1, 18, 601, 0, 0], device)
        cu, num_tokens, num_rows = None, 5, 5
    else:  # rows of 3, 0, 300 and 1 new tokens
        lengths = [3, 0, 300, 1]
        cu = _i32([0, *np.cumsum(lengths)], device)
        starts = [10, 0, 5, 639]
        positions = torch.cat(
            [torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)]
        ).to(device)
        num_tokens, num_rows = sum(lengths), 4
        context_lens = _i32([13, 0, 305, 640], device)
    expected = torch.full((num_tokens + 2,), 7, dtype=torch.int64, device=device)
    got = expected.clone()
    args = (num_tokens, num_rows, block_size)
    derive_slot_mapping_reference(rows, positions, cu, context_lens, expected, *args)
    derive_slot_mapping(rows, positions, cu, context_lens, got, *args)
    assert torch.equal(got, expected)
    assert got[num_tokens:].tolist() == [7, 7]  # nothing written past num_tokens
    if mode == "decode":
        assert got[:5].tolist() == [0, (40 + 1) * 3 * 16 + 1, (80 + 37) * 3 * 16 + 8, -1, -1]

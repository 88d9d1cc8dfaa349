"""DeepSeek-V4 indexer top-k select (atom/kernels/v4_topk.py): the Triton select (CPU
interpreter; `gpu` variants on CUDA) against its torch reference, against torch.topk where
no score ties, and against the tie rule (lower id wins, -0.0 equals 0.0) where they do.
Only each row's visible entries are read: garbage past them never changes the choice."""

import pytest
import torch

from atom.kernels.v4_topk import (
    indexer_topk_select,
    indexer_topk_select_reference,
    visible_counts,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _rows(device, seed, width, positions, ties: bool):
    generator = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values (ReLU zeros among them), both signs of zero
        scores = torch.randint(-2, 3, (len(positions), width), generator=generator) * 0.5
        scores = torch.where(scores == 0, -0.0, scores)
        scores[:, ::3] = 0.0
    else:
        scores = torch.randn(len(positions), width, generator=generator)
    positions = torch.tensor(positions)
    context_lens = (positions + 1).int()
    return scores.float().to(device), positions.to(device), context_lens.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(
    "width,positions,k",
    [(8, [0, 3, 31], 4), (300, [1199, 40, 7, 5000], 16), (3000, [11999, 2], 512)],
)
def test_select_matches_reference_and_topk(device, ties, width, positions, k):
    ratio = 4
    scores, positions, context_lens = _rows(device, width + k, width, positions, ties)
    context_lens[-1] = 0  # a padded row: nothing chosen
    k = min(k, width)
    counts = visible_counts(positions, context_lens, ratio, width)
    expected = indexer_topk_select_reference(scores, counts, k)
    got = indexer_topk_select(scores, counts, k)
    assert torch.equal(got, expected), (got, expected)
    assert (got[-1] == -1).all()
    counts = ((positions + 1) // ratio).clamp(max=width).tolist()
    for row in range(len(counts) - 1):
        n, chosen = counts[row], got[row].tolist()
        picks = sorted(i for i in chosen if i >= 0)
        assert chosen == picks + [-1] * (k - len(picks)) and len(picks) == min(k, n)
        visible = scores[row, :n].cpu()
        if not ties:  # distinct scores: the same set as torch.topk
            assert picks == sorted(visible.topk(min(k, n)).indices.tolist())
        ranked = sorted(range(n), key=lambda i: (-float(visible[i]), i))  # the tie rule
        assert picks == sorted(ranked[: min(k, n)])


@pytest.mark.parametrize("device", DEVICES)
def test_select_reads_only_the_visible_entries(device):
    """Scores past a row's visible count (never written by the scores kernel) do not
    matter: NaN or huge there, the same choice."""
    scores, positions, context_lens = _rows(device, 1, 64, [39, 99], ties=True)
    counts = visible_counts(positions, context_lens, 4, 64)
    clean = indexer_topk_select(scores, counts, 6)
    scores[0, 10:] = float("nan")
    scores[1, 25:] = 1e30
    assert torch.equal(indexer_topk_select(scores, counts, 6), clean)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ties", [False, True])
def test_select_inside_allowed_entries(device, ties):
    """V4.1's second level: only the allowed entries (candidate blocks) count; fewer allowed
    than k leaves -1 after them."""
    scores, positions, context_lens = _rows(device, 5, 2500, [9999, 300, 60, 7], ties)
    generator = torch.Generator().manual_seed(9)
    allowed = (torch.rand(4, 2500, generator=generator) < 0.3).to(device)
    allowed[2] = False
    allowed[2, :5] = True  # 5 allowed of the 15 visible: fewer than k
    counts = visible_counts(positions, context_lens, 4, 2500)
    expected = indexer_topk_select_reference(scores, counts, 16, allowed)
    got = indexer_topk_select(scores, counts, 16, allowed)
    assert torch.equal(got, expected), (got, expected)
    assert got[2].tolist() == [0, 1, 2, 3, 4] + [-1] * 11
    assert (got[3] == -1).sum() == 16 - int(allowed[3, :2].sum())

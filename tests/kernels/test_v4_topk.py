"""DeepSeek-V4 indexer top-k select (atom/kernels/v4_topk.py): the Triton select (CPU
interpreter; `gpu` variants on CUDA) against its torch reference, against torch.topk where
no score ties, and against the tie rule (lower id wins, -0.0 equals 0.0) where they do.
Only each row's visible entries are read: garbage past them never changes the choice.
The split select (S programs a row) gives the same ids as the single-program kernel."""

import pytest
import torch

from atom.kernels import v4_topk
from atom.kernels.v4_topk import (
    MAX_SPLITS,
    indexer_topk_select,
    indexer_topk_select_reference,
    indexer_topk_select_split,
    topk_splits,
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


def _split_rows(seed: int, width: int, k: int):
    """Rows seeing 0, fewer than k, exactly k, and many more than k entries: scores of few
    values of both signs (heavy ties straddling the threshold), -0.0, some -inf."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (5, width), generator=generator) * 0.25
    scores = torch.where(scores == 0, -0.0, scores).float()
    scores[1, : width // 2] = torch.randn(width // 2, generator=generator)  # few ties
    scores[:, 5::11] = float("-inf")
    counts = torch.tensor([0, k // 3, k, width - 7, width])
    return scores, counts


def _allowed(width: int, k: int):
    generator = torch.Generator().manual_seed(2)
    allowed = torch.rand(5, width, generator=generator) < 0.4
    allowed[2, : 3 * k] = True
    return allowed


# (splits, allowed): the rule's own choice (None, 10 slices here) once, the slowest
# under the interpreter; `allowed` at the forced counts
SPLIT_CASES = [(1, False), (1, True), (3, False), (3, True), (7, False), (7, True), (None, False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits, allowed", SPLIT_CASES)
def test_split_select_matches_reference(device, splits, allowed):
    """The split kernels at S = 1, 3, 7 and `topk_splits`' own choice (None; split chunk 64
    so that these interpreter-sized rows split) against the reference and the
    single-program kernel. With ``allowed``, no -inf score (see the next test)."""
    width, k, chunk = 700, 24, 128
    scores, counts = _split_rows(width + 3, width, k)
    mask = None
    if allowed:
        mask = _allowed(width, k).to(device)
        scores = scores.masked_fill(scores == float("-inf"), -7.0)
    scores, counts = scores.to(device), counts.to(device)
    if splits is None:  # a slice per 64 entries of the width at 5 rows
        assert topk_splits(5, width, v4_topk.INTERPRETER_MULTI_PROCESSORS, 64) == 10
        got = indexer_topk_select(scores, counts, k, mask, split_chunk=64, split_warps=4)
    else:
        got = indexer_topk_select_split(scores, counts, k, mask, splits, chunk=chunk)
    expected = indexer_topk_select_reference(scores, counts, k, mask)
    assert torch.equal(got, expected), (got, expected)
    single = indexer_topk_select(scores, counts, k, mask, chunk=chunk, num_splits=1)
    assert torch.equal(got, single), (got, single)
    assert (got[0] == -1).all()


def test_split_select_allowed_with_inf_matches_the_single_program_kernel():
    """-inf scores with ``allowed``: the reference masks with -inf too, so there a masked-out
    entry ties with an allowed -inf (and wins by its lower id); both kernels take only
    allowed entries, the same ones."""
    width, k = 700, 24
    scores, counts = _split_rows(width + 3, width, k)
    mask = _allowed(width, k)
    got = indexer_topk_select_split(scores, counts, k, mask, 3, chunk=128)
    single = indexer_topk_select(scores, counts, k, mask, chunk=128, num_splits=1)
    assert torch.equal(got, single), (got, single)
    picked = got.clamp(min=0)
    assert (mask.gather(1, picked) | (got < 0)).all()


def test_split_select_k_past_the_visible_entries():
    """k wider than the row (the padding shared by the slices over several chunks)."""
    scores, counts = _split_rows(4, 300, 600)
    counts = counts.clamp(max=300)
    expected = indexer_topk_select_reference(scores, counts, 600)
    got = indexer_topk_select_split(scores, counts, 600, None, 3, chunk=128)
    assert torch.equal(got, expected), (got, expected)


def test_topk_splits_choices():
    """One program a row for rows under 8 split chunks or over 1 row in 8 SMs; else a
    slice per chunk of the width, at most MAX_SPLITS (the figures in its docstring)."""
    sms = 132
    assert topk_splits(1, 2048, sms) == 1  # 8K context at max_model_len 8K
    assert topk_splits(1, 8191, sms) == 1
    assert topk_splits(1, 8192, sms) == 8  # max_model_len 32K
    assert topk_splits(1, 16384, sms) == 16  # 64K: 16 slices of 1024
    assert topk_splits(16, 16384, sms) == 16
    assert topk_splits(17, 16384, sms) == 1  # more than 1 row in 8 SMs
    assert topk_splits(64, 1 << 20, sms) == 1
    assert topk_splits(1, 1 << 20, sms) == MAX_SPLITS
    assert topk_splits(1, 3000, sms, chunk=256) == 11
    for rows in (1, 2, 5, 16, 64, 131):
        for width in (4097, 16384, 1 << 18):
            splits = topk_splits(rows, width, sms)
            assert 1 <= splits <= MAX_SPLITS
            assert splits == 1 or (rows * 8 <= sms and width // splits >= 1024)


def test_splits_override_forces_the_split_count(monkeypatch):
    """SPLITS_OVERRIDE (benchmarks' A/B) wins over `topk_splits`: 1 is the single-program
    kernel, here at a shape the rule would split."""
    scores, counts = _split_rows(6, 560, 16)
    launched = []
    real = v4_topk.indexer_topk_select_split
    monkeypatch.setattr(v4_topk, "indexer_topk_select_split",
                        lambda *a, **kw: launched.append(a[4]) or real(*a, **kw))  # fmt: skip
    expected = indexer_topk_select_reference(scores, counts, 16)
    for override, calls in ((1, []), (3, [3]), (None, [3, 8])):  # the rule: 560 // 64
        monkeypatch.setattr(v4_topk, "SPLITS_OVERRIDE", override)
        got = v4_topk.indexer_topk_select(scores, counts, 16, split_chunk=64, split_warps=4)
        assert torch.equal(got, expected)
        assert launched == calls

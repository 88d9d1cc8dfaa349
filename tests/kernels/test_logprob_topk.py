"""The top-k selection from the sampling pass's statistics (atom/kernels/logprob_topk.py)
against a stable descending sort of the fp32 rows: the same log-sum-exp, top values and ids
(ties to the lower index), from the statistics pass alone and from the greedy options pass.
CPU runs the kernels under TRITON_INTERPRET=1 (conftest)."""

from __future__ import annotations

import pytest
import torch

from atom.kernels import logprob_topk, sampling

pytest.importorskip("triton")

BLOCK = sampling.BLOCK
SUB = logprob_topk.SUB
# the kernels: compiled on a GPU machine, interpreted on CPU (a CPU tensor on a GPU
# machine would take the torch reference, whose ties are in any order)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(logits, rows, k: int) -> None:
    logits, rows = logits.to(DEVICE), rows.to(DEVICE)
    want_lse, want_values, want_ids = logprob_topk.topk_lower_index_reference(logits, rows, k)
    lse, values, ids = sampling.logprob_candidates(logits, rows, k)
    torch.testing.assert_close(lse.cpu(), want_lse.cpu(), rtol=0, atol=1e-5)
    assert values.shape == ids.shape == (len(rows), k)
    assert torch.equal(values.cpu(), want_values.cpu())
    assert ids.tolist() == want_ids.tolist()


@pytest.mark.parametrize("k", [1, 20, logprob_topk.KMAX])
def test_equals_stable_sort_bf16_ties_and_partial_block(k):
    generator = torch.Generator().manual_seed(k)
    # bf16: many tied values; the vocabulary is not a multiple of the block or sub-block
    logits = (torch.randn(4, 2 * BLOCK + 77, generator=generator) * 3).to(torch.bfloat16)
    _check(logits, torch.tensor([3, 0, 2]), k)


def test_ties_go_to_the_lower_index_across_blocks_and_sub_blocks():
    vocab = 2 * BLOCK + 5
    logits = torch.full((4, vocab), -2.0)
    logits[0, [7, BLOCK + 3, 2 * BLOCK + 1, 100]] = 5.0  # one value in three blocks
    logits[1] = torch.arange(vocab) % 4  # every sub-block ties at its max: k at the threshold
    logits[2, ::2] = 1.0  # ties, and -0.0 with +0.0
    logits[2, -1] = -0.0
    logits[2, 0] = 0.0
    logits[3] = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    logits[3, [9, 7, BLOCK + 3, SUB + 1]] = 5.0  # ties in one sub-block and across blocks
    logits[3, [BLOCK + 4, 11]] = 4.0
    _check(logits, torch.arange(4), 20)
    _check(logits, torch.tensor([3, 1, 0]), 7)


def test_rows_with_minus_infinity_and_a_small_vocabulary():
    """Whole -inf blocks (the log-sum-exp of the rest), rows with fewer than k finite
    logits (-inf entries, in index order as the stable sort), scattered -inf; and a
    vocabulary of fewer than k sub-blocks."""
    generator = torch.Generator().manual_seed(3)
    vocab = BLOCK + 300
    logits = torch.randn(3, vocab, generator=generator)
    logits[0, :BLOCK] = float("-inf")
    logits[1, 10:] = float("-inf")  # 10 finite values: k = 20 needs -inf entries
    logits[2, ::3] = float("-inf")
    want_values = logprob_topk.topk_lower_index_reference(logits, torch.arange(3), 20)[1]
    finite = want_values.isfinite()
    assert finite[1].sum() == 10 and finite[0].all() and finite[2].all()
    _check(logits, torch.arange(3), 20)
    _check(torch.tensor([[0.5, -1.0, 0.5, 3.0, 2.0]]), torch.tensor([0]), 5)
    _check(torch.randn(2, 3 * SUB - 5, generator=generator), torch.tensor([1, 0]), 20)


def test_statistics_of_the_greedy_options_pass():
    """The greedy pass's statistics (all rows) serve a subset of logprob rows: the raw
    logits' top k, whatever the options did to the argmax."""
    from atom.model_engine.sampling.state import SamplingState

    generator = torch.Generator().manual_seed(7)
    vocab, rows = 3 * BLOCK + 11, 4
    logits = torch.randn(rows, vocab, generator=generator).to(DEVICE)
    state = SamplingState(rows, vocab, torch.device(DEVICE))
    state._allocate()
    state.row_floats[1] = torch.tensor([0.5, 0.3, 1.3])
    state.counts[1, logits[2].argmax()] = 3  # row 2 reads state 1: its argmax penalised
    state_rows = torch.tensor([0, 0, 1, 0], dtype=torch.int32, device=DEVICE)
    tokens, stats = sampling.greedy_with_sampling_options(logits, state_rows, *state.tables(), stats=True)  # fmt: skip
    want = sampling.greedy_with_sampling_options_reference(logits, state_rows, *state.tables())
    assert tokens.tolist() == want.tolist() and want[2] != logits[2].argmax()
    subset = torch.tensor([2, 0], device=DEVICE)
    got = sampling.logprob_candidates(logits, subset, 20, stats=stats)
    lse, values, ids = logprob_topk.topk_lower_index_reference(logits, subset, 20)
    torch.testing.assert_close(got[0], lse, rtol=0, atol=1e-5)
    assert torch.equal(got[1], values) and got[2].tolist() == ids.tolist()


def test_logprob_candidates_select_and_reference():
    """The selection and, past KMAX, the torch reference give the sorted rows' top k."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(3, BLOCK + 9, generator=generator).to(DEVICE)
    rows = torch.tensor([1, 2], device=DEVICE)
    for k in (20, logprob_topk.KMAX + 1):
        want = logprob_topk.topk_lower_index_reference(logits, rows, k)
        lse, values, ids = sampling.logprob_candidates(logits, rows, k)
        torch.testing.assert_close(lse, want[0], rtol=0, atol=1e-5)
        assert torch.equal(values, want[1]), k
        if k <= logprob_topk.KMAX:  # the reference's ties are in any order
            assert ids.tolist() == want[2].tolist()
    with pytest.raises(ValueError, match="1..32"):
        logprob_topk.select_topk(logits, rows, sampling.logit_stats(logits, rows), rows, 33)


@pytest.mark.gpu
def test_select_on_cuda_bf16():
    generator = torch.Generator().manual_seed(11)
    logits = (torch.randn(64, 128256, generator=generator) * 4).to("cuda", torch.bfloat16)
    logits[3, 5000:] = float("-inf")
    logits[4] = torch.arange(128256, device="cuda") % 3  # ties at every sub-block's max
    rows = torch.arange(64, device="cuda")
    for k in (1, 5, 20, logprob_topk.KMAX):
        _check(logits, rows, k)
    _check(logits, torch.tensor([4, 3, 60], device="cuda"), 20)

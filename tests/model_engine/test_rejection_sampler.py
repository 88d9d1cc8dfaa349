"""The verifier on its own: greedy acceptance, and rejection sampling whose emitted token is
distributed as the target's (a statistical test with fixed seeds, against the softmax)."""

import pytest
import torch

from atom.model_engine.sampling.sampler import SamplingTensors
from atom.model_engine.speculative.verify import (
    accepted_tokens,
    fill_device_drafts,
    target_probs,
    verify_rows,
)

VOCAB = 6
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_greedy_rows_accept_exactly_the_argmax():
    logits = torch.eye(4)[[2, 0, 3, 1]] * 5  # argmax per row: 2 0 3 1
    drafts = torch.tensor([2, 0, 1, -1])
    tokens, accepted = verify_rows(logits, SamplingTensors(all_greedy=True), drafts).tolist()
    assert tokens == [2, 0, 3, 1] and accepted == [1, 1, 0, 0]
    # one sequence with 3 drafts: keeps 2, then the target's token at the first mismatch
    assert accepted_tokens([[2, 0, 1]], tokens, accepted) == [[2, 0, 3]]
    assert accepted_tokens([[2], []], [2, 7, 9], [1, 0, 0]) == [[2, 7], [9]]


def _emitted_first_tokens(params, draft: int, samples: int) -> torch.Tensor:
    """The token a sequence emits at its first verify row, `samples` independent times."""
    logits = LOGITS.repeat(samples, 1)
    drafts = torch.full((samples,), draft, dtype=torch.int64)
    tokens, accepted = verify_rows(logits, params, drafts)
    return torch.where(accepted.bool(), drafts, tokens)


@pytest.mark.parametrize("draft", [0, 3, 5, -1])  # likely, unlikely, rare, none (bonus row)
@pytest.mark.parametrize(
    "params",
    [
        SamplingTensors(False, temperature=1.0),
        SamplingTensors(False, temperature=0.7, top_k=torch.full((1,), 4), needs_top_k=True),
    ],
    ids=["t1", "t0.7-topk4"],
)
def test_rejection_sampling_preserves_the_target_distribution(params, draft):
    torch.manual_seed(1234)
    samples = 60_000
    if params.top_k is not None:
        params.top_k = params.top_k.expand(samples)
    emitted = _emitted_first_tokens(params, draft, samples)
    observed = torch.bincount(emitted, minlength=VOCAB).double()
    expected = target_probs(LOGITS.unsqueeze(0), SamplingTensors(False, **_one_row(params)))[0]
    # chi-square over the tokens the target can emit; 99.9% quantile at <= 5 dof is 20.5
    support = expected > 0
    assert observed[~support].sum() == 0
    counts = expected[support].double() * samples
    chi2 = ((observed[support] - counts) ** 2 / counts).sum().item()
    assert chi2 < 20.5, (observed / samples, expected)


def _one_row(params: SamplingTensors) -> dict:
    top_k = params.top_k[:1] if params.top_k is not None else None
    return dict(temperature=params.temperature, top_k=top_k, needs_top_k=params.needs_top_k)


def test_the_test_catches_a_biased_verifier():
    """The classic mistake, resampling from p (not from p without the draft) after a
    rejection, must fail the same chi-square bound."""
    torch.manual_seed(1234)
    samples = 60_000
    params = SamplingTensors(False, temperature=1.0)
    logits = LOGITS.repeat(samples, 1)
    drafts = torch.full((samples,), 3, dtype=torch.int64)
    _, accepted = verify_rows(logits, params, drafts)
    resampled = torch.multinomial(target_probs(logits, params), 1).squeeze(1)
    biased = torch.where(accepted.bool(), drafts, resampled)
    observed = torch.bincount(biased, minlength=VOCAB).double()
    counts = target_probs(LOGITS.unsqueeze(0), params)[0].double() * samples
    assert ((observed - counts) ** 2 / counts).sum().item() > 20.5


def test_seeded_rows_repeat_and_greedy_rows_stay_greedy():
    generator = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    logits = LOGITS.repeat(3, 1)
    drafts = torch.tensor([3, 3, 3])
    temps = torch.tensor([1.0, 1.0, 0.0])
    runs = []
    for _ in range(2):
        params = SamplingTensors(
            False, temperatures=temps, generators=[generator(), generator(), None]
        )
        runs.append(verify_rows(logits, params, drafts).tolist())
    assert runs[0] == runs[1]
    assert runs[0][0][2] == 0 and runs[0][1][2] == 0  # greedy row: argmax, draft 3 rejected


def test_device_drafts_fill_input_ids_and_verify_rows():
    """Two sequences, 2 drafts each, left on the device by the proposer: token 0 of each
    sequence is its last real token, rows 0..1 check the drafts, row 2 checks none."""
    input_ids = torch.tensor([11, 0, 0, 22, 0, 0, 99])  # 99: past the step, untouched
    rows = torch.full((6,), -1)
    fill_device_drafts(input_ids, rows, torch.tensor([1, 2, 3, 4]), num_seqs=2)
    assert input_ids.tolist() == [11, 1, 2, 22, 3, 4, 99]
    assert rows.tolist() == [1, 2, -1, 3, 4, -1]

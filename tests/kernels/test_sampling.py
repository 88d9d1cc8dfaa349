"""Sampling kernels (atom/kernels/sampling.py) against torch references of vLLM's definitions.

The options kernel reads a SamplingState built from host token lists; it must equal
`apply_logits_processors` (the transcription of vLLM's min_tokens, logit_bias and
penalties, itself checked against vLLM's code in tests/model_engine) before and after the
state follows sampled tokens on the device. The logprob kernels must equal log_softmax +
topk + rank of the raw logits. CPU runs them under TRITON_INTERPRET=1 (conftest).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atom.kernels import sampling
from atom.model_engine.sampling.logits_processors import LogitsInputs, apply_logits_processors
from atom.model_engine.sampling.logprobs import compute_logprobs
from atom.model_engine.sampling.state import NULL_ROW, SamplingState
from atom.model_engine.sequence import Sequence, SequenceStatus
from atom.sampling_params import SamplingParams

pytest.importorskip("triton")


def _batch(rows: int, vocab: int, generator: torch.Generator) -> list[Sequence]:
    def ints(n):
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    seqs = []
    for row in range(rows):
        params = SamplingParams(
            max_tokens=64,
            presence_penalty=[0.0, 0.5, -1.0][row % 3],
            frequency_penalty=[0.2, 0.0, 1.5][row % 3],
            repetition_penalty=[1.0, 1.3, 0.7, 2.0][row % 4],
            logit_bias={
                t: float(b) for t, b in zip(ints(row % 4), [3.0, -5.0, 1.5], strict=False)
            }  # fmt: skip
            or None,
            min_tokens=5 if row % 3 == 0 else 0,
            stop_token_ids=ints(2),
        )
        if row == rows - 1:  # a row without options in the same batch (the null row)
            params = SamplingParams(max_tokens=64)
        seq = Sequence(ints(3 + row % 7), params)
        seq.sampling_params.all_stop_token_ids = sorted({2, *params.stop_token_ids})
        seq.token_ids += ints(row % 9)
        seqs.append(seq)
    return seqs


def _state(seqs, vocab, device, capacity=None) -> tuple[SamplingState, torch.Tensor]:
    state = SamplingState(capacity or len(seqs), vocab, torch.device(device))
    state.begin_step(seqs)
    rows = np.zeros(len(seqs), np.int32)
    built = state.rows_for(seqs, rows)
    state.apply_builds(*state.build_tensors(built))
    return state, torch.from_numpy(rows).to(device)


def _reference(seqs, logits, vocab):
    inputs = LogitsInputs.build(seqs, None, vocab, torch.device("cpu"))
    return apply_logits_processors(logits.float().cpu().clone(), inputs)


def _check_greedy(tokens, expected):
    """Each token holds its row's maximum (the first one, up to the last bit of rounding:
    a GPU may fuse the penalty's multiply-subtract)."""
    tokens = tokens.cpu()
    best = expected.max(dim=-1).values
    got = expected.gather(1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(got, best, rtol=1e-6, atol=1e-5)
    first = expected.argmax(dim=-1)
    assert (tokens == first).float().mean() > 0.9


def _check_options(seqs, vocab, device, dtype, generator):
    logits = (torch.randn(len(seqs), vocab, generator=generator) * 3).to(device, dtype)
    state, rows = _state(seqs, vocab, device)
    expected = _reference(seqs, logits, vocab)
    torch.testing.assert_close(
        sampling.apply_sampling_options_reference(logits, rows, *state.tables()).cpu(), expected
    )
    torch.testing.assert_close(
        sampling.apply_sampling_options(logits, rows, *state.tables()).cpu(), expected
    )
    _check_greedy(sampling.greedy_with_sampling_options(logits, rows, *state.tables()), expected)
    # Two steps followed on the device: the sampled tokens counted into their rows.
    for _ in range(2):
        tokens = torch.randint(0, vocab, (len(seqs),), generator=generator)
        state.count_sampled(rows, tokens.to(device))
        for seq, token in zip(seqs, tokens.tolist(), strict=True):
            seq.token_ids.append(token)
        expected = _reference(seqs, logits, vocab)
        torch.testing.assert_close(
            sampling.apply_sampling_options(logits, rows, *state.tables()).cpu(), expected
        )
        greedy = sampling.greedy_with_sampling_options(logits, rows, *state.tables())
        _check_greedy(greedy, expected)


@pytest.mark.parametrize("seed", [0, 1])
def test_options_kernel_equals_vllm_reference_across_steps(seed):
    generator = torch.Generator().manual_seed(seed)
    vocab = 4096 + 905  # blocks of the pass, the last one partial
    _check_options(_batch(7, vocab, generator), vocab, "cpu", torch.float32, generator)


def test_state_rows_are_reclaimed_and_rebuilt():
    """A full state takes back the rows of finished and preempted requests; a preempted
    request rebuilt from its tokens gives the same logits as one that kept its row."""
    generator = torch.Generator().manual_seed(3)
    vocab = 300
    seqs = _batch(4, vocab, generator)[:3]
    state, _ = _state(seqs, vocab, "cpu", capacity=3)
    seqs[0].status = SequenceStatus.FINISHED  # frees its row
    newcomer = _batch(5, vocab, generator)[1]
    batch = [seqs[2], newcomer]  # seqs[1] is preempted: not in the batch
    state.begin_step(batch)
    rows = np.zeros(2, np.int32)
    built = state.rows_for(batch, rows)
    assert built == [newcomer] and NULL_ROW not in rows.tolist()
    state.apply_builds(*state.build_tensors(built))
    logits = torch.randn(2, vocab, generator=generator)
    got = sampling.apply_sampling_options_reference(logits, torch.from_numpy(rows), *state.tables())
    torch.testing.assert_close(got, _reference(batch, logits, vocab))
    # The preempted request returns: rebuilt (its row was taken back), same result.
    state.begin_step([seqs[1], seqs[2]])
    rows = np.zeros(2, np.int32)
    assert state.rows_for([seqs[1], seqs[2]], rows) == [seqs[1]]
    state.apply_builds(*state.build_tensors([seqs[1]]))
    logits = torch.randn(2, vocab, generator=generator)
    got = sampling.apply_sampling_options_reference(logits, torch.from_numpy(rows), *state.tables())
    torch.testing.assert_close(got, _reference([seqs[1], seqs[2]], logits, vocab))


def _check_logprobs(logits, rows, k):
    tokens = torch.randint(0, logits.shape[1], (len(rows),), device=logits.device)
    lse, top_values, top_ids = sampling.logprob_candidates(logits, rows, k)
    chosen = logits[rows, tokens].float()
    ranks = sampling.count_greater(logits, rows, chosen) + 1
    expected = compute_logprobs(logits[rows], tokens, k)
    torch.testing.assert_close((chosen - lse).cpu(), expected.chosen.cpu(), rtol=0, atol=1e-5)
    assert ranks.tolist() == expected.ranks.tolist()
    torch.testing.assert_close(
        (top_values - lse.unsqueeze(1)).cpu(), expected.top_values.cpu(), rtol=0, atol=1e-5
    )
    # Ids carry their values (bf16 logits tie often: ties may come in any order) and are
    # distinct in each row.
    raw = logits[rows].float()
    torch.testing.assert_close(raw.gather(1, top_ids), top_values, rtol=0, atol=0)
    assert all(len(set(ids)) == len(ids) for ids in top_ids.tolist())
    if logits.dtype == torch.float32:
        assert top_ids.tolist() == expected.top_ids.tolist()


@pytest.mark.parametrize("k", [0, 1, 20])
def test_logprob_kernels_equal_log_softmax_topk_and_rank(k):
    generator = torch.Generator().manual_seed(k)
    logits = torch.randn(5, 2 * 4096 + 77, generator=generator) * 4
    _check_logprobs(logits, torch.tensor([4, 0, 2]), k)


@pytest.mark.gpu
def test_sampling_kernels_on_cuda_bf16():
    generator = torch.Generator().manual_seed(11)
    vocab = 128256
    _check_options(_batch(33, vocab, generator), vocab, "cuda", torch.bfloat16, generator)
    logits = (torch.randn(64, vocab, generator=generator) * 4).to("cuda", torch.bfloat16)
    _check_logprobs(logits, torch.arange(64, device="cuda"), 20)


def test_device_bytes_cover_the_state_and_a_sampling_step():
    """What the KV sizing reserves for the SamplingState: its tables once allocated, plus
    the processed logits and statistics of a step at max_num_seqs rows."""
    from atom.kernels import logprob_topk

    seqs, vocab = 6, 5000
    state = SamplingState(seqs, vocab, torch.device("cpu"))
    reserved = state.device_bytes()
    state._allocate()
    tables = sum(t.numel() * t.element_size() for t in state.tables())
    logits = torch.randn(seqs, vocab)
    processed = seqs * vocab * 4  # apply_sampling_options' fp32 output
    stats = logprob_topk.LogitStats(
        torch.empty(seqs, -(-vocab // sampling.BLOCK)), torch.empty(seqs, -(-vocab // sampling.BLOCK)),
        torch.empty(seqs, -(-vocab // logprob_topk.SUB)),
    )  # fmt: skip
    step = processed + sum(t.numel() * 4 for t in vars(stats).values())
    assert sampling.apply_sampling_options_reference(logits, torch.zeros(seqs, dtype=torch.int32), *state.tables()).numel() * 4 == processed  # fmt: skip
    assert tables + step <= reserved <= 1.01 * (tables + step)

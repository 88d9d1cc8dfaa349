"""The threshold-filtered logprob candidates (atom/kernels/logprob_topk.py) against a stable
descending sort of the fp32 rows: the same log-sum-exp, top values and ids (ties to the
lower index), on both of its paths (filtered, and the rounds fallback of a block with many
ties or few finite logits). CPU runs the kernel under TRITON_INTERPRET=1 (conftest)."""

from __future__ import annotations

import pytest
import torch

from atom.kernels import logprob_topk, sampling

pytest.importorskip("triton")

BLOCK = logprob_topk.BLOCK


def _check(logits, rows, k: int, merges=("triton", "torch"), **geometry) -> None:
    """The merges (the Triton kernel, torch.topk of the keys) equal the stable sort."""
    want_lse, want_values, want_ids = logprob_topk.topk_lower_index_reference(logits, rows, k)
    for merge in merges:
        lse, values, ids = logprob_topk.logprob_candidates_filtered(
            logits, rows, k, merge=merge, **geometry
        )
        torch.testing.assert_close(lse.cpu(), want_lse.cpu(), rtol=0, atol=1e-5)
        assert values.shape == ids.shape == (len(rows), k)
        assert torch.equal(values.cpu(), want_values.cpu()), merge
        assert ids.tolist() == want_ids.tolist(), merge


@pytest.mark.parametrize("k", [0, 1, 20])
def test_equals_stable_sort_bf16_ties_and_partial_block(k):
    generator = torch.Generator().manual_seed(k)
    # bf16: many tied values; the vocabulary is not a multiple of the block
    logits = (torch.randn(4, 2 * BLOCK + 77, generator=generator) * 3).to(torch.bfloat16)
    _check(logits, torch.tensor([3, 0, 2]), k)
    _check(logits, torch.tensor([1]), k, sub_block=64, count_threshold=True)


def test_ties_go_to_the_lower_index_across_blocks_and_in_the_fallback():
    vocab = 2 * BLOCK + 5
    logits = torch.full((4, vocab), -2.0)
    logits[0, [7, BLOCK + 3, 2 * BLOCK + 1, 100]] = 5.0  # one value in three blocks
    logits[1] = torch.arange(vocab) % 4  # every block: > CAPACITY candidates (rounds)
    logits[2, ::2] = 1.0  # and ties with the block's last lanes
    logits[2, -1] = -0.0
    logits[2, 0] = 0.0
    logits[3] = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    logits[3, [9, 7, BLOCK + 3]] = 5.0  # filtered path, ties in and across blocks
    logits[3, [BLOCK + 4, 11]] = 4.0
    _check(logits, torch.arange(4), 20)
    _check(logits, torch.tensor([3, 1, 0]), 7, sub_block=64, capacity=32)
    _check(logits, torch.arange(4), 20, merges=("triton",), count_threshold=True)


def test_rows_with_minus_infinity():
    """Whole -inf blocks (the log-sum-exp of the rest), rows with fewer than k finite
    logits (-inf entries, ids in index order as the stable sort), scattered -inf."""
    generator = torch.Generator().manual_seed(3)
    vocab = BLOCK + 300
    logits = torch.randn(3, vocab, generator=generator)
    logits[0, :BLOCK] = float("-inf")  # block 0: no finite logit (rounds, all -inf)
    logits[1, 10:] = float("-inf")  # 10 finite values: k = 20 needs -inf entries
    logits[2, ::3] = float("-inf")
    want_lse, want_values, want_ids = logprob_topk.topk_lower_index_reference(
        logits, torch.arange(3), 20
    )
    finite = want_values.isfinite()
    assert finite[1].sum() == 10 and finite[0].all() and finite[2].all()
    for merge in ("triton", "torch"):
        lse, values, ids = logprob_topk.logprob_candidates_filtered(
            logits, torch.arange(3), 20, merge=merge
        )
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-5)
        assert torch.equal(values, want_values)
        assert ids.tolist() == want_ids.tolist()  # the -inf entries too: lower ids first


def test_small_vocabulary_below_k():
    logits = torch.tensor([[0.5, -1.0, 0.5, 3.0, 2.0]])
    _check(logits, torch.tensor([0]), 5)


def test_logprob_candidates_switch():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(3, BLOCK + 9, generator=generator)
    rows = torch.tensor([1, 2])
    want = logprob_topk.topk_lower_index_reference(logits, rows, 20)
    for method in sampling.CANDIDATE_METHODS:
        lse, values, ids = sampling.logprob_candidates(logits, rows, 20, method=method)
        torch.testing.assert_close(lse, want[0], rtol=0, atol=1e-5)
        assert torch.equal(values, want[1]) and ids.tolist() == want[2].tolist()
    assert sampling.CANDIDATES == "rounds"  # the default until the H200 measures
    with pytest.raises(sampling.CandidateMethodError, match="ATOM_LOGPROB_CANDIDATES"):
        sampling.logprob_candidates(logits, rows, 3, method="sorted")


@pytest.mark.gpu
def test_filtered_candidates_on_cuda_bf16():
    from atom.benchmarks import sampler_breakdown

    generator = torch.Generator().manual_seed(11)
    logits = (torch.randn(64, 128256, generator=generator) * 4).to("cuda", torch.bfloat16)
    logits[3, 5000:] = float("-inf")
    logits[4] = torch.arange(128256, device="cuda") % 3  # the rounds fallback everywhere
    rows = torch.arange(64, device="cuda")
    for k in (0, 1, 5, 20):
        _check(logits, rows, k)
    for sub_block, capacity, count, warps in sampler_breakdown.GEOMETRIES:
        _check(logits, rows, 20, sub_block=sub_block, capacity=capacity,
               count_threshold=count, num_warps=warps)  # fmt: skip


def test_sampler_breakdown_smoke(capsys, monkeypatch):
    """`python -m atom.benchmarks.sampler --breakdown` at a toy shape (kernels interpreted):
    every piece measured, the filtered candidates exact against the stable sort."""
    import json

    from atom.benchmarks import sampler, sampler_breakdown

    geometries = ((32, 64, False, 8),)  # one: interpreted
    monkeypatch.setattr(sampler_breakdown, "GEOMETRIES", geometries)

    argv = "--device cpu --vocab 3000 --batch 2 --iters 1 --prompt-len 8 --output-len 2"
    assert sampler.main([*argv.split(), "--skip-engine", "--breakdown"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    pieces = {r["piece"] for r in lines if r["case"] == "breakdown"}
    assert {"options_greedy", "candidates_rounds_kernel", "filtered_kernel", "count_greater"} <= pieces  # fmt: skip
    candidates = {r["method"]: r for r in lines if r["case"] == "candidates"}
    assert (
        candidates["filtered_32x64_rounds_threshold_8_warps_triton_merge"]["ids_exact"]
        and candidates["rounds"]["values_equal"]
    )
    summary = lines[-1]
    assert summary["case"] == "breakdown_summary" and set(summary["plan_sample_ms"]) == set(
        sampling.CANDIDATE_METHODS
    )

"""`python -m benchmarks.sampler --breakdown` at a toy shape."""

from __future__ import annotations

import pytest
import torch

from atom.kernels import logprob_topk, sampling

pytest.importorskip("triton")


def test_sampler_breakdown_smoke(capsys):
    """`python -m benchmarks.sampler --breakdown` at a toy shape: every piece measured
    (kernels interpreted on CPU, compiled on a GPU machine), each method checked."""
    import json

    from benchmarks import sampler

    device = "cuda" if torch.cuda.is_available() else "cpu"
    argv = f"--device {device} --vocab 3000 --batch 2 --iters 1 --prompt-len 8 --output-len 2"
    assert sampler.main([*argv.split(), "--skip-engine", "--breakdown"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    pieces = {r["piece"] for r in lines if r["case"] == "breakdown"}
    assert {"options_greedy", "options_greedy_stats", "select", "count_greater"} <= pieces
    candidates = {r["method"]: r for r in lines if r["case"] == "candidates"}
    assert candidates["select"]["ids_exact"] and candidates["rounds"]["values_equal"]
    summary = next(r for r in lines if r["case"] == "breakdown_summary")
    assert set(summary["plan_sample_ms"]) == {"select"}


def test_rounds_candidate_matches_the_sorted_rows():
    """benchmarks/candidates/logprob_rounds.py: the same top k as a stable sort."""
    from benchmarks.candidates import logprob_rounds

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(3, sampling.BLOCK + 9, generator=generator).to(device)
    rows = torch.tensor([1, 2], device=device)
    want = logprob_topk.topk_lower_index_reference(logits, rows, 20)
    lse, values, ids = logprob_rounds.rounds_candidates(logits, rows, 20)
    torch.testing.assert_close(lse, want[0], rtol=0, atol=1e-5)
    assert torch.equal(values, want[1]) and ids.tolist() == want[2].tolist()

"""The host side of a step: its log-probability entries (atom/model_engine/logprobs.py),
the frozen start-up heap of the stepping loops (atom/gc_heap.py), and the profile of a
decode step's host phases (atom/benchmarks/engine_host_profile.py).

A step's Logprob entries keep their alternatives in the step's arrays until `top` is
read; what a reader sees must equal the eager conversion of the same tensors."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch

from atom.gc_heap import frozen_heap
from atom.model_engine.logprobs import Logprob, LogprobTensors


def _tensors(rows: int = 6, k: int = 5) -> LogprobTensors:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(rows, k, generator=generator).sort(dim=1, descending=True).values
    return LogprobTensors(
        torch.randn(rows, generator=generator),
        torch.randint(1, 100, (rows,), generator=generator),
        torch.randint(0, 50_000, (rows, k), generator=generator),
        values,
    )


def test_entries_equal_the_eager_conversion():
    t = _tensors()
    tokens, ks = [11, 12, 13, 14, 15, 16], [5, 0, 3, 5, 1, 2]
    entries = t.entries(tokens, ks)
    ids, values = t.top_ids.tolist(), t.top_values.tolist()
    for i, entry in enumerate(entries):
        top = list(zip(ids[i][: ks[i]], values[i][: ks[i]], strict=True))
        expected = Logprob(tokens[i], t.chosen[i].item(), t.ranks[i].item(), top)
        assert entry == expected and repr(entry) == repr(expected)
        assert all(type(a) is int and type(b) is float for a, b in entry.top)
        restored = pickle.loads(pickle.dumps(entry))
        assert restored == expected and restored.top is not entry.top


def test_entries_do_not_read_the_transfer_memory_later():
    """The host tensors (pinned on CUDA) are reused once freed: entries copy them."""
    t = _tensors()
    entries = t.entries([1] * 6, [5] * 6)
    before = t.top_ids[0, :5].tolist()
    t.top_ids.fill_(-1)
    t.top_values.fill_(0.0)
    assert [a for a, _ in entries[0].top] == before


def test_top_can_be_set():
    entry = _tensors().entries([3] * 6, [4] * 6)[2]
    entry.top = [(7, -0.5)]
    assert entry.top == [(7, -0.5)] and entry != Logprob(3, entry.logprob, entry.rank, [])


def test_frozen_heap_skips_old_objects_and_leaves_foreign_freezes():
    if gc.get_freeze_count():  # a server engine thread of the session holds its freeze
        pytest.skip("the heap is frozen by a running engine loop")
    # The permanent generation's count can only fall while frozen (a frozen object that
    # dies leaves it); a second freeze would raise it, an unfreeze would empty it.
    young = []  # objects made after the freeze: a nested freeze would take them in
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        young.extend([object()] for _ in range(1000))
        with frozen_heap():  # nested: already frozen, left as it is
            assert 0 < gc.get_freeze_count() <= frozen
        assert 0 < gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0  # everything collectable again
    gc.freeze()  # someone else's freeze: neither extended nor undone
    try:
        outside = gc.get_freeze_count()
        young.extend([object()] for _ in range(1000))
        with frozen_heap():
            pass
        assert 0 < gc.get_freeze_count() <= outside
    finally:
        gc.unfreeze()


def test_engine_host_profile_smoke(capsys):
    """`python -m atom.benchmarks.engine_host_profile` at a toy shape: every phase of both
    cases, the logprob conversion only with the options, the heap's freeze undone."""
    import json

    from atom.benchmarks import engine_host_profile

    frozen = gc.get_freeze_count()
    argv = ["--device", "cpu", "--batch", "4", "--vocab", "512", "--prompt-len", "8"]
    assert engine_host_profile.main([*argv, "--decode-len", "4"]) == 0
    records = {}
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            records[record["case"]] = record
    plain, options = records["plain"], records["with_options"]
    for record in (plain, options):
        assert record["decode_steps"] >= 2
        assert set(record["phases"]) == set(engine_host_profile.PHASES)
        assert all("ops" in p and "sync_ops" in p for p in record["phases"].values())
    assert plain["phases"]["logprobs"]["ms"] == 0 < options["phases"]["logprobs"]["ms"]
    assert "extra_ms_by_phase" in records["summary"]
    assert gc.get_freeze_count() == frozen

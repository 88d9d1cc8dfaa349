"""The versioned page table: property tests through the scheduler-facing API."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from atom.h2d.contract import PublicationError
from tests.page_table.harness import PageTableHarness, assert_mirror_matches

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _machine(device: str, backend: str, num_slots: int):
    class PageTableMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.h = PageTableHarness(device, backend, num_slots=num_slots, num_blocks=48)
            self.snapshots = {}

        @rule(
            prompt_len=st.integers(1, 40),
            max_tokens=st.integers(1, 30),
            shared=st.booleans(),
        )
        def add(self, prompt_len, max_tokens, shared):
            self.h.add(prompt_len, max_tokens, shared)

        @rule(steps=st.integers(1, 6))
        def step(self, steps):
            for _ in range(steps):
                others = {s.index: s.page_table.device_rows.clone() for s in self.h.slots}
                slot, tables = self.h.step()
                if slot is None:
                    return
                assert_mirror_matches(slot, tables)
                for other in self.h.slots:  # slots never touch each other's state
                    if other is not slot:
                        assert torch.equal(other.page_table.device_rows, others[other.index])

        @rule(index=st.integers(0, 7))
        def finish(self, index):
            self.h.finish(index)

        @rule()
        def preempt(self):
            self.h.preempt()

        @rule(seed=st.integers(0, 1000))
        def reorder(self, seed):
            self.h.reorder(seed)

        @invariant()
        def exact_block_accounting(self):
            bm = self.h.block_manager
            held = {b for s in self.h.scheduler.running for b in s.block_table}
            assert bm.num_free_blocks == bm.num_blocks - len(held)

    return PageTableMachine


@pytest.mark.parametrize("num_slots", [1, 2])
@pytest.mark.parametrize("backend", ["direct", "packed"])
@pytest.mark.parametrize("device", DEVICES)
def test_mirror_equals_rebuild_after_every_step(device, backend, num_slots):
    machine = _machine(device, backend, num_slots)
    machine.TestCase.settings = settings(
        max_examples=25 if device == "cpu" else 12,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    machine.TestCase().runTest()


@pytest.mark.parametrize("device", DEVICES)
def test_unchanged_mapping_costs_nothing_and_appends_only_the_tail(device):
    h = PageTableHarness(device)
    for _ in range(4):
        h.add(prompt_len=6, max_tokens=40)
    slot, _ = h.step()  # prefill: every row new
    table = slot.page_table
    slot, tables = h.step()  # first decode: new layout (decodes only), rows move or stay
    assert_mirror_matches(slot, tables)
    revisions = []
    for _ in range(8):
        before = table.cpu_revision
        slot, tables = h.step()
        assert_mirror_matches(slot, tables)
        grew = table.cpu_revision != before
        revisions.append((grew, table.last_bytes))
    # positions 8..15 of 4-token blocks: a block boundary every 4 steps
    assert any(not grew for grew, _ in revisions)
    assert all(nbytes == 0 for grew, nbytes in revisions if not grew)
    # all 4 rows append one id: (count + 3 ints per delta + 1 offset + 1 id per row) * 4 B
    assert {nbytes for grew, nbytes in revisions if grew} == {(1 + 3 * 4 + 1 + 4) * 4}


def test_a_failed_publication_resends_every_row(monkeypatch):
    h = PageTableHarness("cpu", "packed")
    for _ in range(3):
        h.add(prompt_len=10, max_tokens=20)
    slot, _ = h.step()
    h.step()
    publisher = slot.publisher
    original = publisher.flush

    def broken_flush():
        publisher.abort()
        raise PublicationError("*", slot.index, "injected failure")

    monkeypatch.setattr(publisher, "flush", broken_flush)
    h.add(prompt_len=7, max_tokens=5)  # a new row: the lost step carried deltas
    h.reorder(seed=1)  # and moves
    with pytest.raises(PublicationError, match="injected failure"):
        h.step()
    assert slot.page_table.gpu_revision != slot.page_table.cpu_revision
    monkeypatch.setattr(publisher, "flush", original)
    slot, tables = h.step()
    assert_mirror_matches(slot, tables)


def test_two_micro_batch_slots_keep_independent_revisions():
    h = PageTableHarness("cpu", num_slots=2)
    for _ in range(5):
        h.add(prompt_len=5, max_tokens=12)
    revisions = []
    for _ in range(10):
        slot, tables = h.step()
        assert_mirror_matches(slot, tables)
        revisions.append(tuple(s.page_table.cpu_revision for s in h.slots))
    a, b = zip(*revisions, strict=True)
    assert a != b  # each slot counts its own changes
    assert np.all(np.diff(a) >= 0) and np.all(np.diff(b) >= 0)

"""One test per clause of the publication contract (docs/publication_contract.md)."""

import time

import numpy as np
import pytest
import torch

from atom import envs
from atom.config import Config
from atom.h2d.contract import REPEAT_LAST, ManualTransferEvent, PublicationError, StagedBuffer
from atom.h2d.publisher import DirectPublisher, PackedPublisher
from atom.h2d.slot_buffers import BufferSpec, SlotBuffers

CPU = torch.device("cpu")
SPECS = [
    BufferSpec("slot_mapping", (64,), torch.int64, -1),
    BufferSpec("context_lens", (16,), torch.int32, 0),
    BufferSpec("cu_seqlens_q", (17,), torch.int32, REPEAT_LAST),
    BufferSpec("block_tables", (16, 512), torch.int32, 0, packable=False),
]


def _slot(backend, device=CPU, checked=True, slot=3):
    return SlotBuffers(slot, device, backend, SPECS, checked=checked)


def _stage(slot, values: dict, rows: dict | None = None):
    """One producer step: stage each buffer (at `rows[name]` rows) and write `values`."""
    rows = rows or {}
    with slot.publisher.producer_guard(list(slot.buffers.values())):
        for name, value in values.items():
            value = np.asarray(value)
            view = slot.stage(name, rows.get(name, len(value)))
            view[: len(value)] = value


# -- source lifetime ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["direct", "packed"])
def test_producer_guard_refuses_a_source_still_in_flight(backend):
    slot = _slot(backend)
    buffer = slot["context_lens"]
    buffer.last_transfer = ManualTransferEvent()  # the CPU face of a copy not yet executed
    with pytest.raises(PublicationError, match=r"'context_lens' of runner slot 3.*in flight"):
        with slot.publisher.producer_guard([buffer]):
            slot.stage("context_lens", 1)[0] = 1  # never reached
    assert buffer.array[0] == 0
    buffer.last_transfer.complete()
    with slot.publisher.producer_guard([buffer]):
        slot.stage("context_lens", 1)[0] = 1
    assert slot.publisher.publish(buffer, 1) is not None


def test_production_guard_checks_one_event_per_step():
    slot = _slot("direct", checked=False)
    publisher = slot.publisher
    publisher._last_flush = ManualTransferEvent()
    with pytest.raises(PublicationError, match="in flight"):
        with publisher.producer_guard(list(slot.buffers.values())):
            pass
    publisher._last_flush.complete()
    buffers = list(slot.buffers.values())
    start = time.perf_counter()
    for _ in range(1000):
        with publisher.producer_guard(buffers):
            pass
    per_step_us = (time.perf_counter() - start) / 1000 * 1e6
    assert per_step_us < 20  # measured on the H200 host in docs/benchmarks.md (target <= 3 us)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["direct", "packed"])  # packed: event recorded in-graph
def test_real_in_flight_copy_is_caught(backend):
    device = torch.device("cuda")
    slot = _slot(backend, device)
    buffer = slot["slot_mapping"]
    _stage(slot, {"slot_mapping": np.arange(64)})
    torch.cuda._sleep(200_000_000)  # keep the stream busy so the copy below stays queued
    slot.publisher.publish(buffer, 64)
    slot.publisher.flush()
    with pytest.raises(PublicationError, match="in flight"):
        with slot.publisher.producer_guard([buffer]):
            pass
    slot.publisher.wait_for_transfers()
    with slot.publisher.producer_guard([buffer]):
        pass
    assert buffer.device[:64].tolist() == list(range(64))


# -- identity ------------------------------------------------------------------------------
def test_destination_on_another_device_is_refused():
    host = torch.zeros(8, dtype=torch.int64)
    buffer = StagedBuffer(
        "positions", 1, host, torch.zeros(8, dtype=torch.int64, device="meta"), 0, True
    )
    publisher = DirectPublisher(1, CPU)
    with publisher.producer_guard([buffer]):
        publisher.stage(buffer, 4)[:] = 1
    with pytest.raises(
        PublicationError, match=r"'positions' of runner slot 1: destination lives on meta"
    ):
        publisher.publish(buffer, 4)


@pytest.mark.gpu
def test_stream_not_waited_on_is_refused():
    for checked in (True, False):  # checked: at publish; production: once, at the flush
        slot = _slot("direct", torch.device("cuda"), checked=checked)
        _stage(slot, {"context_lens": [1, 2, 3, 4]})
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):
            with pytest.raises(PublicationError, match="stream the consumers do not wait on"):
                slot.publisher.publish(slot["context_lens"], 4)
                slot.publisher.flush()
        assert slot.publisher.flush() is None  # the failed group was dropped


# -- semantic padding -----------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["direct", "packed"])
def test_pad_values_fill_the_padded_tail(backend):
    slot = _slot(backend)
    publisher = slot.publisher
    _stage(
        slot,
        {"slot_mapping": [5, 6, 7], "context_lens": [9, 9, 9], "cu_seqlens_q": [0, 1, 2, 3]},
        rows={"slot_mapping": 8, "context_lens": 8, "cu_seqlens_q": 9},
    )
    mapping = publisher.publish(slot["slot_mapping"], 3, 8)
    lens = publisher.publish(slot["context_lens"], 3, 8)
    cu = publisher.publish(slot["cu_seqlens_q"], 4, 9)
    publisher.flush()
    assert mapping.tolist() == [5, 6, 7] + [-1] * 5
    assert lens.tolist() == [9, 9, 9] + [0] * 5
    assert cu.tolist() == [0, 1, 2, 3] + [3] * 5


# -- ownership -----------------------------------------------------------------------------
def test_arena_ownership_in_mixed_and_direct_only_steps():
    slot = _slot("packed")
    publisher: PackedPublisher = slot.publisher
    _stage(slot, {"context_lens": [4, 5], "block_tables": np.full((2, 512), 7)})
    assert np.shares_memory(slot["context_lens"].staged, publisher.host_bytes)  # in the arena
    assert not np.shares_memory(slot["block_tables"].staged, publisher.host_bytes)
    publisher.publish(slot["context_lens"], 2)  # packed
    tables = publisher.publish(slot["block_tables"], 2)  # unpackable: direct, same step
    event = publisher.flush()
    assert publisher.arena_transfer is event
    assert (
        slot["context_lens"].last_transfer is event and slot["block_tables"].last_transfer is event
    )
    assert (publisher.copies, publisher.kernels) == (2, 1)
    assert slot["context_lens"].device[:2].tolist() == [4, 5] and tables.eq(7).all()
    _stage(slot, {"block_tables": np.full((1, 512), 8)})
    publisher.publish(slot["block_tables"], 1)  # a step that leaves the arena alone
    later = publisher.flush()
    assert later is not event and publisher.arena_transfer is event


def test_arena_in_flight_is_not_reused():
    slot = _slot("packed")
    slot.publisher.arena_transfer = ManualTransferEvent()
    with pytest.raises(PublicationError, match="packed arena reused"):
        _stage(slot, {"context_lens": [1, 2]})
    slot.publisher.arena_transfer.complete()
    _stage(slot, {"context_lens": [1, 2]})


# -- failure handling ----------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["direct", "packed"])
def test_each_failure_is_named_and_followed_by_a_correct_step(backend):
    slot = _slot(backend)
    publisher = slot.publisher
    lens = slot["context_lens"]
    _stage(slot, {"context_lens": [11, 12], "slot_mapping": np.arange(10)})
    publisher.publish(lens, 2)
    with pytest.raises(
        PublicationError, match=r"'slot_mapping' of runner slot 3: destination too small"
    ):
        publisher.publish(slot["slot_mapping"], 10, 65)
    assert publisher.flush() is None  # the failed group was dropped
    if backend == "packed":
        assert lens.device[:2].tolist() == [0, 0]  # nothing half-published arrived
    with pytest.raises(PublicationError, match="0 staged in this step"):
        publisher.publish(lens, 2)  # the failed step's staging is stale: no reuse
    _stage(slot, {"context_lens": [21, 22]})
    out = publisher.publish(lens, 2)
    publisher.flush()
    assert out.tolist() == [21, 22]


@pytest.mark.parametrize("backend", ["direct", "packed"])
def test_unstaged_or_short_staged_buffer_is_refused(backend):
    """Publishing rows the producer did not write this step would send stale data."""
    slot = _slot(backend)
    _stage(slot, {"context_lens": [1, 2]})
    with pytest.raises(PublicationError, match="'slot_mapping' .* 0 staged in this step"):
        slot.publisher.publish(slot["slot_mapping"], 1)
    _stage(slot, {"context_lens": [1, 2]})
    with pytest.raises(PublicationError, match="'context_lens' .* 4 rows published but 2 staged"):
        slot.publisher.publish(slot["context_lens"], 2, 4)


def test_wrong_dtype_is_refused():
    with pytest.raises(PublicationError, match="'top_p' of runner slot 0: host and device"):
        StagedBuffer("top_p", 0, torch.zeros(4), torch.zeros(4, dtype=torch.float64), 1.0, True)


def test_arena_overflow_is_named_and_the_slot_stays_usable():
    slot = _slot("packed")
    publisher = slot.publisher
    slot.publisher = small = PackedPublisher(3, CPU, slot.device_arena, arena_bytes=128)
    mapping = slot["slot_mapping"]
    with pytest.raises(
        PublicationError, match=r"'slot_mapping' of runner slot 3: packed arena overflow"
    ):
        _stage(slot, {"context_lens": [1], "slot_mapping": np.arange(64)})
    assert small.flush() is None  # nothing queued survives the failure
    slot.publisher = publisher
    _stage(slot, {"slot_mapping": np.arange(64)})
    out = publisher.publish(mapping, 64)
    publisher.flush()
    assert out.tolist() == list(range(64))


# -- the toggle ----------------------------------------------------------------------------
def test_unknown_backend_lists_the_valid_ones(monkeypatch):
    monkeypatch.setenv("ATOM_H2D_BACKEND", "zero-copy")
    with pytest.raises(ValueError, match="valid values: direct, packed"):
        envs.h2d_backend()
    with pytest.raises(ValueError, match="valid values: direct, packed"):
        Config(device="cpu")
    monkeypatch.setenv("ATOM_H2D_BACKEND", "packed")
    assert Config(device="cpu").h2d_backend == "packed"
    assert Config(device="cpu", h2d_backend="direct").h2d_backend == "direct"


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_packed_flush_of_every_size_bucket_lands_exactly(graphs):
    """Steps whose arena use falls in each copy bucket (4 KiB ... whole arena)."""
    specs = [
        BufferSpec("small", (16,), torch.int64, 0),
        BufferSpec("medium", (4096,), torch.int32, -1),
        BufferSpec("large", (16384,), torch.int32, 0),  # 64 KiB: the packing limit
    ]
    slot = SlotBuffers(0, torch.device("cuda"), "packed", specs, checked=True)
    if not graphs:
        slot.publisher._graphs = []  # the eager path: copy, then launch the scatter
    assert bool(slot.publisher._graphs) == graphs
    rng = np.random.default_rng(0)
    for rows in [(3, 0, 0), (16, 1000, 0), (16, 4096, 9000), (5, 4096, 16384), (1, 7, 2)]:
        values = {
            name: rng.integers(0, 1 << 30, n)
            for name, n in zip(("small", "medium", "large"), rows, strict=True)
            if n
        }
        _stage(slot, values)
        views = {name: slot.publisher.publish(slot[name], len(v)) for name, v in values.items()}
        slot.publisher.flush()
        for name, value in values.items():
            assert views[name].cpu().tolist() == value.tolist(), name
        slot.publisher.wait_for_transfers()

"""Publishers: how a runner slot's staged buffers reach their device destinations.

One step, seen from the publisher (docs/publication_contract.md):

    with publisher.producer_guard(buffers):   # refuses if host memory is still in flight
        publisher.stage(buffer, rows)[:n] = ...   # producers write numpy views
    publisher.publish(buffer, valid, padded)  # at the buffer's first consumer
    publisher.flush()                         # send the group; one event covers it

direct: `stage` hands out the buffer's own pinned memory; one non_blocking copy per
        published buffer.
packed: `stage` hands out a slice of one pinned arena (bump allocation, 64-byte aligned),
        so producers write straight into it; the flush sends the arena with ONE copy and
        ONE Triton kernel scatters the segments into their fixed destinations. Buffers
        that are not packable (or too large) stage in their own memory and go direct in
        the same step; the arena's `arena_transfer` is set only by a flush that used it.

Checked mode verifies every clause at every call. Production mode keeps the O(1) checks
(bounds, staged this step), checks the stream once per flush and the producer guard with
one event query per step; identity of devices is verified once, when the slot is built.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from atom.graph_capture import capture_graph
from atom.h2d.contract import PublicationError, StagedBuffer, TransferEvent
from atom.kernels.scatter import (
    HEADER_WORDS,
    scatter_segments,
    scatter_segments_reference,
)

logger = logging.getLogger(__name__)

ALIGN = 64  # bytes; every packed segment starts on a 64-byte boundary
MAX_SEGMENTS = 32
HEADER_BYTES = -(-(HEADER_WORDS + 3 * MAX_SEGMENTS) * 8 // ALIGN) * ALIGN
EVENT_RING = 4


def stream_id_reader(device: torch.device):
    """A cheap `() -> current stream id` for `device` (torch.cuda.current_stream builds a
    Python Stream object per call, which alone would eat the production check budget)."""
    get = getattr(torch._C, "_cuda_getCurrentStream", None)
    index = device.index
    if get is not None:
        return lambda: get(index)[0]
    return lambda: torch.cuda.current_stream(device).stream_id


class Publisher:
    backend = "base"

    def __init__(self, slot: int, device: torch.device, checked: bool = True, stream=None):
        self.slot = slot
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.checked = checked
        self.stream = (
            stream
            if stream is not None
            else (torch.cuda.current_stream(device) if device.type == "cuda" else None)
        )
        self._current_stream_id = stream_id_reader(device) if self.stream is not None else None
        self._stream_id = self.stream.stream_id if self.stream is not None else None
        self._events = [TransferEvent.for_device(device) for _ in range(EVENT_RING)]
        self._next_event = 0
        self._group: list[StagedBuffer] = []
        self._last_flush: TransferEvent | None = None  # None once known complete
        self.step = 0  # producer steps begun; a buffer staged in an older step is stale
        self.copies = 0  # host-to-device copies issued (cumulative)
        self.kernels = 0  # scatter kernels launched (cumulative)
        self.bytes = 0  # bytes sent host-to-device (cumulative)

    # -- producer side ---------------------------------------------------------------------
    def producer_guard(self, buffers: list[StagedBuffer]) -> Publisher:
        """Begin a step; refuse (raise) before any write if host memory is still in flight.

        checked: every buffer's own last transfer (and the packed arena's); production:
        the slot's last flush only, one event query per step (none once it is known done).
        Use as `with publisher.producer_guard(buffers): ...`; an exception inside drops
        the half-staged step.
        """
        self.check_producer(buffers)
        self._begin_step()
        return self

    def check_producer(self, buffers: list[StagedBuffer]) -> None:
        """The guard's check (see producer_guard); raises PublicationError."""
        if self.checked:
            for buffer in buffers:
                buffer.check_writable()
            self._check_arena_writable()
        elif self._last_flush is not None:
            if not self._last_flush.query():
                raise PublicationError(
                    "*",
                    self.slot,
                    "producer started while the slot's last publication is in flight",
                    "call wait_for_transfers() first",
                )
            self._last_flush = None

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.abort()

    def _check_arena_writable(self, name: str = "*") -> None:
        pass

    def _begin_step(self) -> None:
        self.step += 1
        self._group = []

    def stage(self, buffer: StagedBuffer, rows: int) -> np.ndarray:
        """A writable numpy view of `rows` rows of `buffer` for this step's producer.

        `rows` must cover the padded length the buffer will be published with."""
        if rows > buffer.capacity:
            raise PublicationError(
                buffer.name,
                self.slot,
                f"destination too small: {rows} rows asked, {buffer.capacity} allocated",
                "raise max_num_seqs / max_num_batched_tokens",
            )
        view = self._stage(buffer, rows)
        buffer.staged, buffer.staged_rows, buffer.staged_step = view, rows, self.step
        return view

    def _stage(self, buffer: StagedBuffer, rows: int) -> np.ndarray:
        buffer.arena_offset = -1
        return buffer.array[:rows]

    def wait_for_transfers(self) -> None:
        if self._last_flush is not None:
            self._last_flush.synchronize()
            self._last_flush = None

    # -- publication -----------------------------------------------------------------------
    def in_bounds(self, buffer: StagedBuffer, valid: int, padded: int) -> bool:
        """The production check of one publication: staged in this step, and
        0 <= valid <= padded <= the rows staged (which `stage` bounded by the capacity)."""
        return buffer.staged_step == self.step and 0 <= valid <= padded <= buffer.staged_rows

    def _validate(self, buffer: StagedBuffer, valid: int, padded: int) -> None:
        """Every clause, naming the first one broken. Production mode runs only the O(1)
        clauses inline in `publish` (staged rows <= capacity holds by `stage`) and comes
        here when one fails, to name it."""
        if not 0 <= valid <= padded:
            raise PublicationError(
                buffer.name, self.slot, f"valid length {valid} outside [0, {padded}]"
            )
        if padded > buffer.capacity:
            raise PublicationError(
                buffer.name,
                self.slot,
                f"destination too small: {padded} rows asked, {buffer.capacity} allocated",
                "raise max_num_seqs / max_num_batched_tokens",
            )
        if buffer.staged_step != self.step or padded > buffer.staged_rows:
            staged = buffer.staged_rows if buffer.staged_step == self.step else 0
            raise PublicationError(
                buffer.name,
                self.slot,
                f"{padded} rows published but {staged} staged in this step",
                "write the rows through publisher.stage(buffer, padded_rows) first",
            )
        if not self.checked:
            return
        if buffer.device.device != self.device:
            raise PublicationError(
                buffer.name,
                self.slot,
                f"destination lives on {buffer.device.device}, this publisher on {self.device}",
            )
        self.check_stream(buffer.name)
        if (
            buffer.host.dtype != buffer.device.dtype
            or buffer.host.shape[1:] != buffer.device.shape[1:]
        ):
            raise PublicationError(
                buffer.name, self.slot, "host and destination shape or dtype differ"
            )

    def check_stream(self, name: str = "*") -> None:
        if self._stream_id is not None and self._current_stream_id() != self._stream_id:
            raise PublicationError(
                name,
                self.slot,
                "published from a stream the consumers do not wait on",
                "publish on the slot's stream",
            )

    def publish(self, buffer: StagedBuffer, valid: int, padded: int | None = None) -> torch.Tensor:
        """Pad rows [valid, padded) and queue rows [0, padded) for the device.

        Returns the destination view; its data is in place once `flush` has run (before
        any consumer kernel is queued)."""
        if padded is None:
            padded = valid
        try:
            if self.checked or not self.in_bounds(buffer, valid, padded):
                self._validate(buffer, valid, padded)
            if padded > valid:
                buffer.write_padding(valid, padded)
            self._queue(buffer, padded)
        except PublicationError:
            self.abort()
            raise
        self._group.append(buffer)
        view = buffer._device_views.get(padded)
        return view if view is not None else buffer.device_view(padded)

    def _queue(self, buffer: StagedBuffer, rows: int) -> None:
        raise NotImplementedError

    def flush(self) -> TransferEvent | None:
        """Send what `publish` queued; one event covers the group."""
        if not self._group:
            return None
        if not self.checked:
            try:
                self.check_stream(self._group[0].name)
            except PublicationError:
                self.abort()
                raise
        arena_used, event = self._send()
        if event is None:
            event = self._events[self._next_event].record(self.stream)
            self._next_event = (self._next_event + 1) % EVENT_RING
        for buffer in self._group:
            buffer.last_transfer = event
        self._group = []
        self._last_flush = event
        self._after_flush(event, arena_used)
        return event

    def _send(self) -> tuple[bool, TransferEvent | None]:
        """Issue the group's remaining transfers: (arena used, event already recorded
        after them or None)."""
        return False, None

    def _after_flush(self, event: TransferEvent, arena_used: bool) -> None:
        pass

    def abort(self) -> None:
        """Drop a half-built group: nothing of it reaches the device; the slot stays usable.

        Everything staged in this step becomes stale: the next step stages afresh."""
        self._group = []
        self.step += 1


class DirectPublisher(Publisher):
    backend = "direct"

    def _queue(self, buffer: StagedBuffer, rows: int) -> None:
        if buffer.aliased or rows == 0:
            return
        buffer.device_view(rows).copy_(buffer.host_view(rows), non_blocking=True)
        self.copies += 1
        self.bytes += rows * buffer.row_bytes


class PackedPublisher(DirectPublisher):
    """Stages small buffers in one pinned arena; large or unpackable ones go direct.

    Arena layout: a header of int64 words (number of segments, then one
    (src_offset, dst_offset, num_bytes) row per segment), then the staged segments.
    The flush sends bytes [0, end of the last published segment) with one copy, and the
    scatter kernel, which reads the header on the device, writes the segments out. On
    CUDA the copy, the scatter and the recording of the flush's completion event of each
    transfer-size bucket (4 KiB, 16 KiB, 64 KiB, 256 KiB, the whole arena) are captured
    together in one CUDA graph: a flush is one graph replay (the copy of a bucket sends the
    bucket's bytes; the scatter only uses the described segments). Each bucket has its own
    event, re-recorded by every replay: a buffer still pointing at it then waits for a
    later point of the stream, which is stricter, never looser.
    """

    backend = "packed"

    def __init__(
        self,
        slot: int,
        device: torch.device,
        device_arena: torch.Tensor,
        arena_bytes: int = 1 << 20,
        max_packed_bytes: int = 64 << 10,
        checked: bool = True,
        stream=None,
        scatter_graph: bool = True,
    ):
        super().__init__(slot, device, checked, stream)
        self.device_arena = device_arena  # uint8: every destination is a view into it
        pin = device.type == "cuda"
        size = HEADER_BYTES + arena_bytes
        self.host_arena = torch.zeros(size, dtype=torch.uint8, pin_memory=pin)
        self.host_bytes = self.host_arena.numpy()
        self.header = self.host_bytes[:HEADER_BYTES].view(np.int64)
        self.staging = torch.zeros(size, dtype=torch.uint8, device=device)  # landing zone
        self.max_packed_bytes = max_packed_bytes
        self.arena_transfer: TransferEvent | None = None  # owner: the last group that used it
        self._copy_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._offset = HEADER_BYTES  # next free staging byte of this step
        self._descriptors: list[int] = []  # published this step, 3 ints per segment
        self._header_descriptors: list[int] | None = None  # what the host header holds
        self._end = 0  # end of the last published segment
        # (bucket bytes, graph, the event its replay records)
        self._graphs: list[tuple[int, torch.cuda.CUDAGraph, TransferEvent]] = []
        if device.type == "cuda" and scatter_graph:
            self._graphs = self._capture_flushes()

    def _capture_flushes(self) -> list[tuple[int, torch.cuda.CUDAGraph, TransferEvent]]:
        self.header[0] = 0
        self.staging[:HEADER_BYTES].copy_(self.host_arena[:HEADER_BYTES])
        self._launch_scatter()  # compile outside the capture
        torch.cuda.synchronize(self.device)
        size = self.host_bytes.size
        buckets = sorted({min(b, size) for b in (4 << 10, 16 << 10, 64 << 10, 256 << 10)})
        if buckets[-1] != size:
            buckets.append(size)
        graphs = []

        def flush(bucket: int, event: torch.cuda.Event) -> None:
            self.staging[:bucket].copy_(self.host_arena[:bucket], non_blocking=True)
            self._launch_scatter()
            event.record()  # external: an event-record node, replayed with the graph

        try:
            for bucket in buckets:
                event = torch.cuda.Event(external=True)
                graph, _ = capture_graph(lambda bucket=bucket, event=event: flush(bucket, event))
                graphs.append((bucket, graph, TransferEvent(event)))
        except RuntimeError as error:  # capture unsupported here: issue them one by one
            logger.warning("packed h2d: flush graphs unavailable (%s); eager flushes", error)
            torch.cuda.synchronize(self.device)
            return []
        return graphs

    def _launch_scatter(self) -> None:
        if self.device.type == "cuda":
            scatter_segments(self.staging, self.device_arena, MAX_SEGMENTS)
        else:
            scatter_segments_reference(self.staging, self.device_arena)

    def _check_arena_writable(self, name: str = "*") -> None:
        if self.arena_transfer is not None and not self.arena_transfer.query():
            raise PublicationError(
                name,
                self.slot,
                "packed arena reused while its transfer is in flight",
                "wait for the slot's transfers before staging",
            )

    def _begin_step(self) -> None:
        super()._begin_step()
        self._offset, self._descriptors, self._end = HEADER_BYTES, [], 0

    def publish(self, buffer: StagedBuffer, valid: int, padded: int | None = None) -> torch.Tensor:
        """The common case inline (production checks passed, staged in the arena); anything
        else (checked mode, direct buffers, a failed check) takes the general path."""
        if padded is None:
            padded = valid
        offset = buffer.arena_offset
        if (
            self.checked
            or offset < 0
            or len(self._descriptors) == 3 * MAX_SEGMENTS
            or not self.in_bounds(buffer, valid, padded)
        ):
            return super().publish(buffer, valid, padded)
        if padded > valid:
            buffer.write_padding(valid, padded)
        nbytes = padded * buffer.row_bytes
        self._descriptors += (offset, buffer.dst_offset, nbytes)
        if offset + nbytes > self._end:
            self._end = offset + nbytes
        self._group.append(buffer)
        view = buffer._device_views.get(padded)
        return view if view is not None else buffer.device_view(padded)

    def _stage(self, buffer: StagedBuffer, rows: int) -> np.ndarray:
        nbytes = rows * buffer.row_bytes
        if not buffer.packable or nbytes > self.max_packed_bytes:
            return super()._stage(buffer, rows)
        start = self._offset
        if start == HEADER_BYTES and self.checked:
            self._check_arena_writable(buffer.name)
        if start + nbytes > self.host_bytes.size:
            self.abort()
            raise PublicationError(
                buffer.name,
                self.slot,
                f"packed arena overflow ({start + nbytes} > {self.host_bytes.size} bytes)",
                "raise arena_bytes or mark the buffer unpackable",
            )
        self._offset = start + -(-nbytes // ALIGN) * ALIGN
        buffer.arena_offset = start
        view = self.host_bytes[start : start + nbytes].view(buffer.array.dtype)
        return view.reshape((rows, *buffer.row_shape)) if buffer.row_shape else view

    def _queue(self, buffer: StagedBuffer, rows: int) -> None:
        if buffer.arena_offset < 0:
            return super()._queue(buffer, rows)
        if len(self._descriptors) == 3 * MAX_SEGMENTS:
            raise PublicationError(
                buffer.name, self.slot, f"more than {MAX_SEGMENTS} packed segments in one step"
            )
        nbytes = rows * buffer.row_bytes
        self._descriptors += (buffer.arena_offset, buffer.dst_offset, nbytes)
        end = buffer.arena_offset + nbytes
        if end > self._end:
            self._end = end

    def _send(self) -> tuple[bool, TransferEvent | None]:
        descriptors = self._descriptors
        if not descriptors:
            return False, None
        if descriptors != self._header_descriptors:  # steady decode: the same layout
            count = len(descriptors) // 3
            self.header[: 1 + 3 * count] = [count, *descriptors]
            self._header_descriptors = descriptors
        self.copies += 1
        self.kernels += 1
        end = self._end
        for bucket, graph, event in self._graphs:  # one replay: copy, scatter, event
            if end <= bucket:
                graph.replay()
                self.bytes += bucket
                return True, event
        # CPU, or graphs disabled: the same operations, issued one by one
        end = -(-end // ALIGN) * ALIGN
        views = self._copy_views.get(end)
        if views is None:  # one pair of views per transfer size: no slicing per step
            views = self._copy_views[end] = (self.staging[:end], self.host_arena[:end])
        views[0].copy_(views[1], non_blocking=True)
        self._launch_scatter()
        self.bytes += end
        return True, None

    def _after_flush(self, event: TransferEvent, arena_used: bool) -> None:
        if arena_used:
            self.arena_transfer = event
        self._descriptors, self._end = [], 0

    def abort(self) -> None:
        super().abort()
        self._offset, self._descriptors, self._end = HEADER_BYTES, [], 0


def make_publisher(
    backend: str, slot: int, device: torch.device, device_arena: torch.Tensor, checked: bool
):
    if backend == "direct":
        return DirectPublisher(slot, device, checked)
    if backend == "packed":
        return PackedPublisher(slot, device, device_arena, checked=checked)
    raise ValueError(f"unknown h2d backend {backend!r}; valid values: direct, packed")

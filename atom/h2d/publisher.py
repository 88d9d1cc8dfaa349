"""Publishers: how a runner slot's staged buffers reach their device destinations.

direct: one non_blocking copy per buffer.
packed: eligible buffers' valid bytes are packed (numpy, no torch copies) into one pinned
        arena, sent with ONE host-to-device copy, and scattered into their fixed
        destinations by ONE Triton kernel; ineligible buffers go direct in the same step.

A step publishes a group of buffers (`publish` each, then `flush`); the flush records one
TransferEvent that becomes the `last_transfer` of every buffer it carried, and of the
packed arena only when the group really used it.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from atom.h2d.contract import PublicationError, StagedBuffer, TransferEvent
from atom.kernels.scatter import scatter_segments, scatter_segments_reference

ALIGN = 64  # bytes; every packed segment starts on a 64-byte boundary
MAX_SEGMENTS = 64
HEADER_BYTES = MAX_SEGMENTS * 3 * 8  # int64 (src_offset, dst_offset, num_bytes) rows


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
        self._group: list[StagedBuffer] = []
        self._last_flush: TransferEvent | None = None
        self.copies = 0  # host-to-device copies issued (cumulative)
        self.kernels = 0  # scatter kernels launched (cumulative)
        self.bytes = 0  # bytes sent host-to-device (cumulative)

    # -- producer side ---------------------------------------------------------------------
    @contextmanager
    def producer_guard(self, buffers: list[StagedBuffer]):
        """Refuse to let a producer write host memory whose transfer is still in flight.

        checked: every buffer's own last transfer; production: the slot's last flush only
        (one query per step)."""
        if self.checked:
            for buffer in buffers:
                buffer.check_writable()
        elif self._last_flush is not None and not self._last_flush.query():
            raise PublicationError(
                "*",
                self.slot,
                "producer started while the slot's last publication is in flight",
                "call wait_for_transfers() first",
            )
        yield

    def wait_for_transfers(self) -> None:
        if self._last_flush is not None:
            self._last_flush.synchronize()

    # -- publication -----------------------------------------------------------------------
    def _validate(self, buffer: StagedBuffer, valid: int, padded: int) -> None:
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
        if buffer.device.device != self.device:
            raise PublicationError(
                buffer.name,
                self.slot,
                f"destination lives on {buffer.device.device}, this publisher on {self.device}",
            )
        if self.stream is not None and torch.cuda.current_stream(self.device) != self.stream:
            raise PublicationError(
                buffer.name,
                self.slot,
                "published from a stream the consumers do not wait on",
                "publish on the slot's stream",
            )
        if (
            buffer.host.dtype != buffer.device.dtype
            or buffer.host.shape[1:] != buffer.device.shape[1:]
        ):
            raise PublicationError(
                buffer.name, self.slot, "host and destination shape or dtype differ"
            )

    def publish(self, buffer: StagedBuffer, valid: int, padded: int | None = None) -> torch.Tensor:
        """Pad rows [valid, padded) and queue rows [0, padded) for the device.

        Returns the destination view; its data is in place once `flush` has run (before
        any consumer kernel is queued)."""
        padded = valid if padded is None else padded
        try:
            self._validate(buffer, valid, padded)
            buffer.write_padding(valid, padded)
            self._queue(buffer, padded)
        except PublicationError:
            self.abort()
            raise
        self._group.append(buffer)
        return buffer.device[:padded]

    def _queue(self, buffer: StagedBuffer, rows: int) -> None:
        raise NotImplementedError

    def flush(self) -> TransferEvent | None:
        """Send what `publish` queued; one event covers the group."""
        if not self._group:
            return None
        arena_used = self._send()
        event = TransferEvent.record(self.device, self.stream)
        for buffer in self._group:
            buffer.last_transfer = event
        self._group = []
        self._last_flush = event
        self._after_flush(event, arena_used)
        return event

    def _send(self) -> bool:
        return False

    def _after_flush(self, event: TransferEvent, arena_used: bool) -> None:
        pass

    def abort(self) -> None:
        """Drop a half-built group: nothing of it reaches the device; the slot stays usable."""
        self._group = []


class DirectPublisher(Publisher):
    backend = "direct"

    def _queue(self, buffer: StagedBuffer, rows: int) -> None:
        if buffer.aliased or rows == 0:
            return
        buffer.device[:rows].copy_(buffer.host[:rows], non_blocking=True)
        self.copies += 1
        self.bytes += rows * buffer.row_bytes


class PackedPublisher(DirectPublisher):
    """Packs small buffers into one pinned arena; large or unpackable ones go direct."""

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
    ):
        super().__init__(slot, device, checked, stream)
        self.device_arena = device_arena  # uint8: every destination is a view into it
        pin = device.type == "cuda"
        self.host_arena = torch.zeros(HEADER_BYTES + arena_bytes, dtype=torch.uint8, pin_memory=pin)
        self.host_bytes = self.host_arena.numpy()
        self.descriptors = self.host_bytes[:HEADER_BYTES].view(np.int64).reshape(MAX_SEGMENTS, 3)
        self.staging = torch.empty_like(self.host_arena, device=device)  # device landing zone
        self.max_packed_bytes = max_packed_bytes
        self.arena_transfer: TransferEvent | None = None  # owner: the last group that used it
        self._offset = HEADER_BYTES
        self._segments = 0
        self._max_segment = 0

    def _fits(self, buffer: StagedBuffer, nbytes: int) -> bool:
        return buffer.packable and nbytes <= self.max_packed_bytes and self._segments < MAX_SEGMENTS

    def _queue(self, buffer: StagedBuffer, rows: int) -> None:
        nbytes = rows * buffer.row_bytes
        if not self._fits(buffer, nbytes):
            return super()._queue(buffer, rows)
        if (
            self._segments == 0
            and self.arena_transfer is not None
            and not self.arena_transfer.query()
        ):
            raise PublicationError(
                buffer.name, self.slot, "packed arena reused while its transfer is in flight"
            )
        start = self._offset
        if start + nbytes > self.host_arena.numel():
            raise PublicationError(
                buffer.name,
                self.slot,
                f"packed arena overflow ({start + nbytes} > {self.host_arena.numel()} bytes)",
                "raise arena_bytes or mark the buffer unpackable",
            )
        source = buffer.array[:rows].reshape(-1).view(np.uint8)
        self.host_bytes[start : start + nbytes] = source
        dst_offset = buffer.device.data_ptr() - self.device_arena.data_ptr()
        self.descriptors[self._segments] = (start, dst_offset, nbytes)
        self._segments += 1
        self._max_segment = max(self._max_segment, nbytes)
        self._offset = start + -(-nbytes // ALIGN) * ALIGN

    def _send(self) -> bool:
        if self._segments == 0:
            return False
        used = self._offset
        self.staging[:used].copy_(self.host_arena[:used], non_blocking=True)
        descriptors = self.staging[:HEADER_BYTES].view(torch.int64).view(MAX_SEGMENTS, 3)
        scatter = scatter_segments if self.device.type == "cuda" else scatter_segments_reference
        scatter(self.staging, self.device_arena, descriptors, self._segments, self._max_segment)
        self.copies += 1
        self.kernels += 1
        self.bytes += used
        return True

    def _after_flush(self, event: TransferEvent, arena_used: bool) -> None:
        if arena_used:
            self.arena_transfer = event
        self._offset, self._segments, self._max_segment = HEADER_BYTES, 0, 0

    def abort(self) -> None:
        super().abort()
        self._offset, self._segments, self._max_segment = HEADER_BYTES, 0, 0


def make_publisher(
    backend: str, slot: int, device: torch.device, device_arena: torch.Tensor, checked: bool
):
    if backend == "direct":
        return DirectPublisher(slot, device, checked)
    if backend == "packed":
        return PackedPublisher(slot, device, device_arena, checked=checked)
    raise ValueError(f"unknown h2d backend {backend!r}; valid values: direct, packed")

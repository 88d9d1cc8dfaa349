"""The publication contract: errors, transfer events, and a named staged buffer.

See docs/publication_contract.md. A StagedBuffer is one piece of step metadata: host
staging memory (pinned on CUDA, written through numpy views) and a fixed device
destination (CUDA-graph safe). Each step a producer asks the publisher for a writable
view of the rows it fills (`Publisher.stage`): the buffer's own host memory (direct) or a
slice of the slot's packed arena (packed). That memory may be rewritten only once the
transfer that last read it has completed; the producer guard checks that before any write.
"""

from __future__ import annotations

import numpy as np
import torch

REPEAT_LAST = "repeat_last"  # pad by repeating the last valid value (cu_seqlens)


class PublicationError(RuntimeError):
    """A publication broke the contract; names the buffer, the slot and what to do."""

    def __init__(self, buffer: str, slot: int, problem: str, hint: str = ""):
        self.buffer, self.slot = buffer, slot
        message = f"h2d: buffer {buffer!r} of runner slot {slot}: {problem}"
        super().__init__(message + (f"; {hint}" if hint else ""))


class TransferEvent:
    """Completion of a group of transfers. CUDA: a recorded event; CPU: already done.

    Publishers keep a small ring of these and re-record them: a buffer that still points
    at a re-recorded event then waits for a later point of the same stream, which is
    stricter, never looser, than its own transfer.
    """

    def __init__(self, event: torch.cuda.Event | None = None):
        self._event = event

    @classmethod
    def for_device(cls, device: torch.device) -> TransferEvent:
        return cls(torch.cuda.Event() if device.type == "cuda" else None)

    def record(self, stream=None) -> TransferEvent:
        if self._event is not None:
            self._event.record(stream)
        return self

    def query(self) -> bool:
        return self._event is None or self._event.query()

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class ManualTransferEvent(TransferEvent):
    """A transfer that stays in flight until `complete()` (tests of the CPU path)."""

    def __init__(self):
        super().__init__(None)
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def complete(self) -> None:
        self.done = True


class StagedBuffer:
    """Host staging memory + fixed device destination of one named metadata buffer.

    pad: the value written into rows [valid, padded) (or REPEAT_LAST).
    packable: small enough to travel in the packed arena.
    """

    def __init__(
        self, name: str, slot: int, host: torch.Tensor, device: torch.Tensor, pad, packable: bool
    ):
        if host.shape != device.shape or host.dtype != device.dtype:
            raise PublicationError(name, slot, "host and device shapes or dtypes differ")
        self.name = name
        self.slot = slot
        self.host = host
        self.array: np.ndarray = host.numpy()  # the buffer's own host memory
        self.device = device
        self.pad = pad
        self.packable = packable
        self.row_shape = tuple(host.shape[1:])
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * host.element_size()
        self.last_transfer: TransferEvent | None = None
        self.dst_offset = 0  # byte offset of `device` in the slot's device arena
        # This step's staging (set by Publisher.stage): where the producer wrote.
        self.staged_step = -1
        self.staged: np.ndarray = self.array[:0]
        self.staged_rows = 0
        self.arena_offset = -1  # byte offset in the packed host arena, -1: own memory
        self._device_views: dict[int, torch.Tensor] = {}
        self._host_views: dict[int, torch.Tensor] = {}
        if pad != REPEAT_LAST:
            self.array.fill(pad)
            if device.data_ptr() != host.data_ptr():
                device.fill_(pad)

    def device_view(self, rows: int) -> torch.Tensor:
        """device[:rows], cached: torch slicing costs microseconds per call."""
        view = self._device_views.get(rows)
        if view is None:
            view = self._device_views[rows] = self.device[:rows]
        return view

    def host_view(self, rows: int) -> torch.Tensor:
        view = self._host_views.get(rows)
        if view is None:
            view = self._host_views[rows] = self.host[:rows]
        return view

    @property
    def capacity(self) -> int:
        return self.host.shape[0]

    @property
    def aliased(self) -> bool:
        """Host and device are the same memory (CPU, direct): publishing copies nothing."""
        return self.device.data_ptr() == self.host.data_ptr()

    def check_writable(self) -> None:
        if self.last_transfer is not None and not self.last_transfer.query():
            raise PublicationError(
                self.name,
                self.slot,
                "host source rewritten while its last transfer is still in flight",
                "wait for the slot's transfers (RunnerSlot.wait_for_transfers) before preparing",
            )

    def write_padding(self, valid: int, padded: int) -> None:
        if padded > valid:
            staged = self.staged
            if self.pad == REPEAT_LAST:
                staged[valid:padded] = staged[valid - 1]
            else:
                staged[valid:padded] = self.pad

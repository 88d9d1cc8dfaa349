"""The publication contract: errors, transfer events, and a named staged buffer.

See docs/publication_contract.md. A StagedBuffer is one piece of step metadata: host
staging memory (pinned on CUDA, written through a numpy view) and a fixed device
destination (CUDA-graph safe). Its host memory may be rewritten only once the transfer
that last read it has completed; the producer guard checks that before any write.
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
    """Completion of a group of transfers. CUDA: a recorded event; CPU: already done."""

    def __init__(self, event: torch.cuda.Event | None = None):
        self._event = event

    @classmethod
    def record(cls, device: torch.device, stream=None) -> TransferEvent:
        if device.type != "cuda":
            return cls(None)
        event = torch.cuda.Event()
        event.record(stream)
        return cls(event)

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
        self.array: np.ndarray = host.numpy()
        self.device = device
        self.pad = pad
        self.packable = packable
        self.row_bytes = (
            host[0].numel() * host.element_size() if host.dim() else host.element_size()
        )
        self.last_transfer: TransferEvent | None = None
        if pad != REPEAT_LAST:
            self.array.fill(pad)
            if device.data_ptr() != host.data_ptr():
                device.fill_(pad)

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
            if self.pad == REPEAT_LAST:
                self.array[valid:padded] = self.array[valid - 1]
            else:
                self.array[valid:padded] = self.pad

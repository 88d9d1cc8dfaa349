"""Allocation of a runner slot's staged buffers and its publisher.

Every device destination is a view into one device arena (one allocation per slot, fixed
addresses: CUDA graphs captured on them stay valid), which is also what lets the packed
publisher's single scatter kernel address every destination from one base pointer.
On CPU with the direct backend, host and device are the same memory (nothing to copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.h2d.contract import StagedBuffer
from atom.h2d.publisher import ALIGN, Publisher, make_publisher


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pad: object
    packable: bool = True  # small per-step metadata; False sends it direct in every mode


class SlotBuffers:
    def __init__(
        self, slot: int, device: torch.device, backend: str, specs: list[BufferSpec], checked: bool
    ):
        self.slot = slot
        self.backend = backend
        pin = device.type == "cuda"
        alias = device.type == "cpu" and backend == "direct"
        offsets, total = {}, 0
        for spec in specs:
            offsets[spec.name] = total
            nbytes = (
                torch.Size(spec.shape).numel() * torch.empty((), dtype=spec.dtype).element_size()
            )
            total += -(-nbytes // ALIGN) * ALIGN
        self.device_arena = (
            None if alias else torch.zeros(max(total, ALIGN), dtype=torch.uint8, device=device)
        )
        self.buffers: dict[str, StagedBuffer] = {}
        for spec in specs:
            host = torch.zeros(spec.shape, dtype=spec.dtype, pin_memory=pin)
            if alias:
                dest = host
            else:
                nbytes = host.numel() * host.element_size()
                start = offsets[spec.name]
                dest = self.device_arena[start : start + nbytes].view(spec.dtype).view(spec.shape)
            buffer = StagedBuffer(spec.name, slot, host, dest, spec.pad, spec.packable)
            if not alias:
                buffer.dst_offset = offsets[spec.name]
            self.buffers[spec.name] = buffer
        self.publisher: Publisher = make_publisher(
            backend, slot, device, self.device_arena, checked
        )

    def __getitem__(self, name: str) -> StagedBuffer:
        return self.buffers[name]

    def stage(self, name: str, rows: int):
        """This step's writable numpy view of `rows` rows of buffer `name`."""
        return self.publisher.stage(self.buffers[name], rows)

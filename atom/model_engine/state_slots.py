"""Per-sequence state slots: memory a sequence owns that is not KV blocks.

Qwen3-Next's GDN layers (atom/attention/gdn.py) keep, per sequence, a conv state and a
delta-rule state, declared with `state_specs` and laid out by `allocate_state` below.
DeepSeek-V4 keeps, per sequence, the sliding-window ring of every layer and the partial
window of each compressor (atom/attention/v4.py). Those tensors have one row per state
slot. The slot belongs to the sequence's KV allocation: the BlockManager hands one out
when it admits the sequence and takes it back in `BlockManager.free` (finish, abort,
preemption), the single free path. A backend reads `seq.state_slot`; it never allocates.
"""

from __future__ import annotations

import math

import torch


class StateSlotError(RuntimeError):
    """A state slot was asked for with none free, or returned twice."""


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"need at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._in_use = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise StateSlotError(
                f"all {self.num_slots} state slots are in use; lower max_num_seqs or finish "
                "a request first"
            )
        slot = self._free.pop()
        self._in_use[slot] = True
        return slot

    def free(self, slot: int) -> None:
        if not self._in_use[slot]:
            raise StateSlotError(f"state slot {slot} freed twice")
        self._in_use[slot] = False
        self._free.append(slot)


# -- per-slot tensors declared by the layers that keep state ------------------------------
# A layer with per-sequence state (GDN: conv state and delta-rule state) declares
# `state_specs() -> {attribute: (shape per slot, dtype)}`; the ModelRunner sizes and binds
# them here, `num_slots + 1` rows each (the last row is scratch for padded rows, slot -1).


def state_bytes(layers, num_slots: int) -> int:
    """Bytes of every declared state tensor of `layers`, scratch row included."""
    total = 0
    for layer in layers:
        for shape, dtype in layer.state_specs().values():
            total += math.prod(shape) * dtype.itemsize
    return total * (num_slots + 1)


def allocate_state(layers, num_slots: int, device) -> list:
    """Zeroed state tensors ``[num_slots + 1, *shape]``, bound as the layers' attributes."""
    tensors = []
    for layer in layers:
        for name, (shape, dtype) in layer.state_specs().items():
            tensor = torch.zeros((num_slots + 1, *shape), dtype=dtype, device=device)
            setattr(layer, name, tensor)
            tensors.append(tensor)
    return tensors


def slot_tensors(attention_layers, state_layers) -> list:
    """Every bound per-slot tensor of a model (``[num_slots + 1, ...]`` each): the V4 / V4.1
    layers' `state_shapes` (rings, compressor rows, Engram history) and the state layers'
    `state_specs` (GDN conv and delta-rule states). Paged pools are not among them."""
    tensors = []
    for layer in attention_layers:
        if hasattr(layer, "state_shapes"):
            tensors += [getattr(layer, name) for name in layer.state_shapes()]
    for layer in state_layers:
        tensors += [getattr(layer, name) for name in layer.state_specs()]
    return tensors

"""Per-sequence state slots: memory a sequence owns that is not KV blocks.

Qwen3-Next's GDN layers (atom/attention/gdn.py) keep, per sequence, a conv state and a
delta-rule state; DeepSeek-V4 the sliding-window ring of every layer and the partial window
of each compressor (atom/attention/v4.py); V4.1 also the Engram history. The model's
attention family declares them (its state contract) and `allocate_state` below lays them
all out, one row per state slot. The slot belongs to the sequence's KV allocation: the
BlockManager hands one out when it admits the sequence and takes it back in
`BlockManager.free` (finish, abort, preemption), the single free path. A backend reads
`seq.state_slot`; it never allocates.
"""

from __future__ import annotations

import torch

from atom.attention.family import StateTensor


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


# -- the one allocator of per-sequence state -----------------------------------------------
# A family's state contract (AttentionFamily.state_contract, atom/attention/family.py) names
# every per-sequence tensor: V4's and V4.1's window rings, compressor rows and Engram history,
# GDN's conv and delta-rule states. Each gets `num_slots + 1` rows (the last row is scratch
# for padded rows, slot -1), bound as its owner layer's attribute.


def state_bytes(contract: list[StateTensor], num_slots: int) -> int:
    """Bytes of every state tensor of `contract`, scratch row included."""
    return sum(spec.bytes_per_slot for spec in contract) * (num_slots + 1)


def allocate_state(contract: list[StateTensor], num_slots: int, device) -> list[torch.Tensor]:
    """Zeroed state tensors ``[num_slots + 1, *shape]``, bound as their owners' attributes;
    returned in contract order (speculation's snapshots back up the same list)."""
    tensors = []
    for spec in contract:
        tensor = torch.zeros((num_slots + 1, *spec.shape), dtype=spec.dtype, device=device)
        setattr(spec.owner, spec.name, tensor)
        tensors.append(tensor)
    return tensors

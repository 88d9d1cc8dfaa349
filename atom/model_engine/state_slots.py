"""Per-sequence state slots: memory a sequence owns that is not KV blocks.

DeepSeek-V4 keeps, per sequence, the sliding-window ring of every layer and the partial
window of each compressor (atom/attention/v4.py). Those tensors have one row per state
slot. The slot belongs to the sequence's KV allocation: the BlockManager hands one out
when it admits the sequence and takes it back in `BlockManager.free` (finish, abort,
preemption), the single free path. A backend reads `seq.state_slot`; it never allocates.
"""

from __future__ import annotations


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

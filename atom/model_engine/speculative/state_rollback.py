"""Exact rollback of rejected drafts for families with per-sequence state (state slots).

A verify step runs the last real token and every draft of a sequence through the model.
Memory addressed by position (paged KV, V4's compressed entries and indexer keys, V4.1's
entry pools) is rewritten when those positions are computed again, so moving
`num_computed_tokens` back past the rejected drafts undoes them (`POSITIONS`). State rows
are different (`STATE_SNAPSHOT`, atom/attention/backend.py): V4's and V4.1's window rings
(`window` rows: a draft at position q overwrites the row of q - window, which later
queries still read), compressor partial rows and V4.1's Engram history, GDN's conv and
delta-rule states are updated in place by every token, drafts included.

So, per verify step (SpeculativeDecoder):
1. `save`, before the launch: the state rows of each drafting sequence are copied to its
   backup rows (one backup row per state slot, every per-slot tensor of the model);
2. after the verify step, a sequence that rejected any draft gets its rows back
   (`restore`) and its `num_computed_tokens` back to where the step began: its next step
   recomputes its last real token, the accepted drafts and the bonus token (a short
   chunk; no extra forward), followed by new drafts while the step stays within k + 1
   tokens (SpeculativeDecoder.lookahead). A sequence that kept every draft keeps the
   state as written.

The copies are device-to-device `_foreach_copy_` calls over row views (one per dtype of the
state tensors; the views are built once per slot): no index upload, no host wait, and the
state of sequences that are not drafting is not touched. Paged memory needs nothing: the
recompute rewrites every position from the rolled-back count on before a query reads it
(an entry closing at position q is visible to queries at positions >= q only).

Cost (docs/speculative_decoding.md, "Models with per-sequence state"): the backup rows
(the per-sequence state once more, off the KV budget); per verify step, a copy of each
drafting sequence's state and another for each one that rejected; after a rejection, the
recompute of the kept tokens, which takes the room of as many drafts in the next step.
"""

from __future__ import annotations

import torch

from atom.attention.backend import POSITIONS, STATE_SNAPSHOT, SpeculationSupport


def uses_state_snapshots(config, speculation: SpeculationSupport, num_state_slots: int) -> bool:
    """Whether the target's rejected drafts roll back by state snapshot: speculation on and
    a family that declares it, with state slots (a Qwen3-Next without GDN layers has none:
    positions suffice). A family declaring no known exact rollback is refused."""
    method = config.speculative_method
    if method is None:
        return False
    if speculation.rollback not in (POSITIONS, STATE_SNAPSHOT):
        raise ValueError(
            f"speculative_method={method!r} is not supported for this model: its attention "
            f"backend declares no exact rollback of rejected drafts ({speculation.rollback!r})"
        )
    return speculation.rollback == STATE_SNAPSHOT and num_state_slots > 0


class StateSnapshots:
    """Backup rows of every per-slot state tensor (the family's state contract, as
    `state_slots.allocate_state` returns them)."""

    def __init__(self, tensors: list[torch.Tensor], num_slots: int):
        self.tensors = tensors
        self.backups = [
            torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in tensors
        ]
        self._views: dict[int, list[tuple[list, list]]] = {}  # slot -> per dtype (live, backup)
        self.saved = 0  # sequence-steps whose rows were saved / restored (tests, benchmarks)
        self.restored = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.backups)

    def _rows(self, slot: int) -> list[tuple[list, list]]:
        views = self._views.get(slot)
        if views is None:
            groups: dict[torch.dtype, tuple[list, list]] = {}
            for live, backup in zip(self.tensors, self.backups, strict=True):
                rows = groups.setdefault(live.dtype, ([], []))
                rows[0].append(live[slot])
                rows[1].append(backup[slot])
            views = self._views[slot] = list(groups.values())
        return views

    def _copy(self, slots: list[int], to_backup: bool) -> None:
        lists: dict[int, tuple[list, list]] = {}  # per dtype group: (destinations, sources)
        for slot in slots:
            for group, (live, backup) in enumerate(self._rows(slot)):
                dst, src = lists.setdefault(group, ([], []))
                dst += backup if to_backup else live
                src += live if to_backup else backup
        for dst, src in lists.values():
            torch._foreach_copy_(dst, src)

    def save(self, slots: list[int]) -> None:
        """Copy the state rows of `slots` to their backup rows (queued on the stream)."""
        if slots:
            self._copy(slots, to_backup=True)
            self.saved += len(slots)

    def restore(self, slots: list[int]) -> None:
        """Copy the backup rows of `slots` back over their state rows."""
        if slots:
            self._copy(slots, to_backup=False)
            self.restored += len(slots)

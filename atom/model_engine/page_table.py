"""The versioned page table: KV block ids per batch position, shared by every backend.

One PageTable per RunnerSlot (pipeline stage / two-batch-overlap micro-batch), each with
its own revisions, host rows and device mirror. The slot hands it the two staged buffers
that carry its changes (`page_moves`, `page_deltas`) and the publisher to send them with;
the table never sees the slot. Device row r holds the block ids of the sequence at batch
position r of the slot's last step. Attention backends read it through
`publish` (atom/attention/backend.py) and derive their own views on the device (slot
mapping, per-token indices); none builds a block table of its own.

Host rows (numpy over pinned memory) are kept per *sequence*, not per position: a
sequence keeps its host row while it stays in the slot's batch, so a reorder moves rows
on the device only and costs the host nothing but the bookkeeping.

Revisions: `cpu_revision` bumps whenever the host rows or the layout change;
`gpu_revision` is the revision the device mirror holds, advanced only after the
publication that carried the change succeeded (`on_published`, after the slot's flush).

What a step costs (`sync`):
- unchanged mapping (same batch layout as the slot's previous step, no sequence gained a
  block): nothing, O(1), 0 bytes;
- appends: only the new tail ids of the rows that grew are staged as (row, start, ids)
  deltas: O(#grown) work, bytes independent of the batch size;
- a new layout (requests added, finished, preempted or reordered): rows that moved are
  moved on the device (valid ids only, never the full row width), new rows are sent in
  full, rows that stayed put cost one comparison each (no page-id scan).

The scheduler describes each batch with `layout` (equal for two batches with the same
sequences in the same order), `grown` (sequences that received blocks while it was
scheduled) and `step` (batch number: a slot that skipped one, e.g. two slots taking
turns, cannot trust `grown` and takes the layout path). Sequences carry `block_version`,
bumped when their blocks are freed, so a re-admitted sequence never reuses a stale row.

Failure handling: a failed publication loses its deltas; the next sync sees
gpu_revision != cpu_revision and resends every row in full.
"""

from __future__ import annotations

import numpy as np
import torch

from atom.graph_capture import capture_graph
from atom.h2d.contract import StagedBuffer
from atom.h2d.publisher import Publisher
from atom.kernels.page_table import (
    apply_row_deltas,
    apply_row_deltas_reference,
    move_rows,
    move_rows_reference,
)


class PageTableError(RuntimeError):
    """The device mirror disagrees with the host rows (debug check), or bad input."""


class _Entry:
    """A resident sequence: its host row, batch position, valid ids, block version."""

    __slots__ = ("host_row", "position", "length", "version")

    def __init__(self, host_row: int, position: int, length: int, version: int):
        self.host_row = host_row
        self.position = position
        self.length = length
        self.version = version


class _Deltas:
    """(row, start, block ids) deltas of one step, gathered as flat lists."""

    __slots__ = ("positions", "starts", "counts", "ids", "host_rows")

    def __init__(self):
        self.positions: list[int] = []  # device row (batch position)
        self.starts: list[int] = []  # first column written
        self.counts: list[int] = []
        self.ids: list[int] = []  # every delta's block ids, back to back
        self.host_rows: list[int] = []

    def add(self, position: int, start: int, ids: list[int], host_row: int) -> None:
        self.positions.append(position)
        self.starts.append(start)
        self.counts.append(len(ids))
        self.ids.extend(ids)
        self.host_rows.append(host_row)


class PageTable:
    def __init__(
        self,
        moves: StagedBuffer,
        deltas: StagedBuffer,
        publisher: Publisher,
        max_rows: int,
        max_blocks_per_row: int,
        device: torch.device,
        checked: bool = False,
    ):
        # Row moves [n | sources | destinations | lengths], then (row, start, block ids)
        # deltas [n | rows | starts | offsets | ids]: only what changed since the last step.
        self.moves = moves
        self.deltas = deltas
        self.publisher = publisher
        self.max_rows = max_rows
        self.width = max_blocks_per_row
        self.device = device
        self.checked = checked  # compare the device mirror with the host rows each step
        pin = device.type == "cuda"
        self.host_rows = torch.zeros((max_rows, self.width), dtype=torch.int32, pin_memory=pin)
        self.rows = self.host_rows.numpy()
        self.device_rows = torch.zeros((max_rows, self.width), dtype=torch.int32, device=device)
        self._scratch = torch.zeros_like(self.device_rows)  # moves go through it
        self._views: dict[int, torch.Tensor] = {}
        self.entries: dict[int, _Entry] = {}  # seq_id -> resident sequence
        self.positions: list[_Entry] = []  # batch position -> entry
        self._free_host_rows = list(range(max_rows - 1, -1, -1))
        self.cpu_revision = 0
        self.gpu_revision = 0
        self.layout = None  # scheduler layout of the last synced step
        self.step = None
        self._pending = None  # (revision, #moves, #deltas) staged, applied after the flush
        self.last_bytes = 0  # delta + move bytes staged by the last sync (benchmarks)
        # The device-side launches never change (counts are read on the device): on CUDA
        # they are replayed from graphs, a few microseconds instead of a Triton launch.
        self._graphs = self._capture() if device.type == "cuda" else None

    def _apply_moves(self) -> None:
        mover = move_rows if self.device.type == "cuda" else move_rows_reference
        mover(self.device_rows, self._scratch, self.moves.device, self.max_rows)

    def _apply_deltas(self) -> None:
        apply = apply_row_deltas if self.device.type == "cuda" else apply_row_deltas_reference
        apply(self.device_rows, self.deltas.device, self.max_rows)

    def _capture(self) -> tuple:
        graphs = []
        for launch in (self._apply_moves, self._apply_deltas):
            launch()  # compile outside the capture (the buffers hold count 0: a no-op)
            torch.cuda.synchronize(self.device)
            graphs.append(capture_graph(launch)[0])
        return tuple(graphs)

    # -- host side (under the slot's producer guard) ---------------------------------------
    def sync(self, seqs, layout=None, grown=(), step: int | None = None) -> None:
        """Bring the table to `seqs` (batch order) and stage the device changes."""
        self._pending = None
        self.last_bytes = 0
        consecutive = step is not None and self.step is not None and step == self.step + 1
        same_layout = layout is not None and layout == self.layout and consecutive
        self.layout, self.step = layout, step
        if self.gpu_revision != self.cpu_revision:  # a lost publication: resend all
            self.entries, self.positions = {}, []
            self._free_host_rows = list(range(self.max_rows - 1, -1, -1))
            self._relayout(seqs)
        elif same_layout:
            if grown:
                self._append(grown)
        else:
            self._relayout(seqs)
        if self.checked:
            self._check_host(seqs)

    def _append(self, grown) -> None:
        deltas = _Deltas()
        positions, starts, counts = deltas.positions, deltas.starts, deltas.counts
        ids, host_rows = deltas.ids, deltas.host_rows
        entries = self.entries
        for seq in grown:
            entry = entries.get(seq.seq_id)
            if entry is None:  # in the other slot's part of the batch
                continue
            start = entry.length
            if entry.version != seq.block_version:  # freed and re-admitted
                start, entry.version = 0, seq.block_version
            table = seq.block_table
            count = len(table) - start
            if count > 0:
                positions.append(entry.position)
                starts.append(start)
                counts.append(count)
                host_rows.append(entry.host_row)
                if count == 1:
                    ids.append(table[-1])
                else:
                    ids.extend(table[start:])
                entry.length = len(table)
            elif count < 0:  # returned blocks (speculative drafts): columns past it unread
                entry.length = len(table)
        self._stage([], deltas)

    def _relayout(self, seqs) -> None:
        if len(seqs) > self.max_rows:
            raise PageTableError(
                f"{len(seqs)} sequences in one step; the page table has {self.max_rows} rows"
            )
        old = self.entries
        kept = {}
        for seq in seqs:
            entry = old.get(seq.seq_id)
            if entry is not None and entry.version == seq.block_version:
                kept[seq.seq_id] = entry
        for seq_id, entry in old.items():  # rows of sequences that left the batch
            if seq_id not in kept:
                self._free_host_rows.append(entry.host_row)
        moves, deltas, positions = [], _Deltas(), []
        for row, seq in enumerate(seqs):
            table = seq.block_table
            entry = kept.get(seq.seq_id)
            if entry is None:
                entry = _Entry(self._free_host_rows.pop(), row, len(table), seq.block_version)
                kept[seq.seq_id] = entry
                deltas.add(row, 0, table, entry.host_row)
            else:
                if entry.position != row:
                    moves.append((entry.position, row, entry.length))
                    entry.position = row
                if len(table) > entry.length:
                    deltas.add(row, entry.length, table[entry.length :], entry.host_row)
                    entry.length = len(table)
                elif len(table) < entry.length:  # returned blocks: nothing to send
                    entry.length = len(table)
            positions.append(entry)
        self.entries, self.positions = kept, positions
        self._stage(moves, deltas)

    def _stage(self, moves, deltas: _Deltas) -> None:
        """Write the changes into the host rows and this step's h2d staging buffers.

        Nothing to send (e.g. the batch only lost its last rows): no revision either."""
        n = len(deltas.positions)
        if not moves and not n:
            return
        stage = self.publisher.stage
        if moves:
            m = len(moves)
            staged = stage(self.moves, 1 + 3 * m)
            staged[0] = m
            staged[1:] = np.asarray(moves, dtype=np.int32).T.reshape(-1)
            self.last_bytes += 4 * (1 + 3 * m)
        if n == 1:  # one row grew or arrived: no array building
            count = deltas.counts[0]
            start = deltas.starts[0]
            staged = stage(self.deltas, 5 + count)
            staged[:5] = (1, deltas.positions[0], start, 0, count)
            staged[5:] = deltas.ids
            self.rows[deltas.host_rows[0], start : start + count] = staged[5:]
            self.last_bytes += 4 * (5 + count)
        elif n:
            total = len(deltas.ids)
            staged = stage(self.deltas, 3 * n + 2 + total)
            staged[0] = n
            body = staged[1:]
            body[:n] = deltas.positions
            body[n : 2 * n] = deltas.starts
            body[2 * n] = 0
            np.cumsum(deltas.counts, out=body[2 * n + 1 : 3 * n + 1])
            ids = body[3 * n + 1 :]
            ids[:] = deltas.ids
            # the same ids into the host rows, in one fancy-indexed write
            if total == n:  # one id per row (decode appends)
                self.rows[deltas.host_rows, deltas.starts] = ids
            else:
                counts = np.asarray(deltas.counts)
                first = np.repeat(body[2 * n : 3 * n] - body[n : 2 * n], counts)
                columns = np.arange(total) - first
                self.rows[np.repeat(deltas.host_rows, counts), columns] = ids
            self.last_bytes += 4 * (3 * n + 2 + total)
        self.cpu_revision += 1
        self._pending = (self.cpu_revision, len(moves), n)

    # -- publication (at the first consumer: attention metadata) ----------------------------
    def publish(self, padded_rows: int) -> torch.Tensor:
        """Queue this step's changes with the publisher; returns the rows view (current on
        the device once the publisher has flushed and `on_published` has run)."""
        pending = self._pending
        if pending is not None:
            publish = self.publisher.publish
            _, num_moves, num_deltas = pending
            if num_moves:
                publish(self.moves, 1 + 3 * num_moves)
            if num_deltas:
                publish(self.deltas, self.deltas.staged_rows)
        view = self._views.get(padded_rows)
        if view is None:
            view = self._views[padded_rows] = self.device_rows[:padded_rows]
        return view

    def on_published(self) -> None:
        """After the publisher's flush: apply the changes on the device; advance gpu_revision."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        revision, num_moves, num_deltas = pending
        graphs = self._graphs
        if num_moves:
            graphs[0].replay() if graphs else self._apply_moves()
        if num_deltas:
            graphs[1].replay() if graphs else self._apply_deltas()
        self.gpu_revision = revision
        if self.checked:
            self.check_device()

    # -- debug checks ----------------------------------------------------------------------
    def _check_host(self, seqs) -> None:
        for row, seq in enumerate(seqs):
            entry = self.positions[row]
            n = len(seq.block_table)
            if (
                entry.position != row
                or entry.length != n
                or self.rows[entry.host_row, :n].tolist() != seq.block_table
            ):
                raise PageTableError(
                    f"host row of sequence {seq.seq_id} (position {row}) differs from its "
                    "block table"
                )

    def check_device(self) -> None:
        """Compare the device mirror's valid ids with the host rows (synchronizes)."""
        device = self.device_rows[: len(self.positions)].cpu().numpy()
        for row, entry in enumerate(self.positions):
            n = entry.length
            if not np.array_equal(device[row, :n], self.rows[entry.host_row, :n]):
                raise PageTableError(
                    f"device row {row} differs from its host row after publication "
                    f"(cpu_revision {self.cpu_revision}, gpu_revision {self.gpu_revision})"
                )

"""Per-request sampling state kept on the device across steps: the SamplingState.

What penalties, logit_bias and min_tokens need lives in device tensors owned by this one
object, one *state row* per running request that asks for any of them (row 0 is the null
row: neutral options, used by requests without them):

    counts      [R, V] int32  output-token counts, the sign bit (PROMPT_FLAG) = a token of
                              the prompt
    row_floats  [R, 3] f32    presence, frequency, repetition
    row_ints    [R, 4] int32  min_tokens, output tokens so far, bias entries, stop ids
    bias_tokens / bias_values [R, Wb], stop_ids [R, Ws]   (widths grow on demand)
    bias_start  [R, blocks + 1] int32  each row's bias entries sorted by token, and where
                              each block of the sampling pass's BLOCK logits starts in them

A row is *built* once, at its request's first sampling step (the end of its prefill), from
the host's token ids: the step stages the row's options, prompt and output tokens in the
runner slot's buffers and publishes them at the sampler (atom/h2d). From then on the row
follows the request on the device: after every step the sampled tokens are counted into
their rows (`count_sampled`) - no host round trip, and nothing staged for rows that did
not change. Reordering the batch changes only the [S] map of sampling rows to state rows.

Rows are released lazily: when no row is free, the rows of finished requests and of
requests outside the current batch (preempted) are taken back. A preempted request that
lost its row is rebuilt from its token ids when it samples again (recompute keeps its
tokens); one that kept it goes on from it. With asynchronous scheduling the token in
flight is already counted on the device when the next step is prepared, so the host's
placeholder never has to be read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from atom.kernels import sampling as kernels
from atom.model_engine.failures import guard_each
from atom.model_engine.sequence import PLACEHOLDER_TOKEN

NULL_ROW = 0
NO_TOKEN = torch.iinfo(torch.int32).max  # unused bias slots: sorted after every token


class SamplingStateError(RuntimeError):
    """The sampling state cannot serve a request (names it and what to do)."""


@dataclass
class StagedBuilds:
    """Row builds staged this step: `rows` of them; entries = prompt, output, bias, stop."""

    rows: int
    num_prompt: int
    num_output: int
    num_bias: int
    num_stop: int

    @property
    def num_entries(self) -> int:
        return self.num_prompt + self.num_output + self.num_bias + self.num_stop


class SamplingState:
    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device):
        self.num_rows = max_num_seqs + 1
        self.vocab_size = vocab_size
        self.device = device
        self._row_of: dict[int, int] = {}  # seq_id -> state row
        self._owner: list = [None] * self.num_rows  # the sequence holding each row
        self._free = list(range(self.num_rows - 1, NULL_ROW, -1))
        self.epoch = 0  # bumps whenever a held row is taken back (cached maps go stale)
        self._batch_seqs: list = []  # the whole step's sequences: never evicted
        self.counts: torch.Tensor | None = None  # allocated with the first row
        self.row_floats = self.row_ints = None
        self.bias_tokens = self.bias_values = self.stop_ids = self.bias_start = None
        self._block_edges = None

    def begin_step(self, seqs: list) -> None:
        """The sequences of the step being launched (all micro-batches)."""
        self._batch_seqs = seqs

    # -- host side ---------------------------------------------------------------------------
    def rows_for(self, seqs: list, out: np.ndarray) -> list:
        """Write each sampling sequence's state row into `out` [len(seqs)]; returns the
        sequences whose row must be built this step (newly assigned rows)."""
        builds = []
        row_of = self._row_of
        for i, seq in enumerate(seqs):
            if not seq.sampling_params.processes_logits:
                out[i] = NULL_ROW
                continue
            row = row_of.get(seq.seq_id)
            if row is None:
                row = self._assign(seq, seqs)
                builds.append(seq)
            out[i] = row
        return builds

    def _assign(self, seq, step_seqs: list) -> int:
        if self.counts is None:
            self._allocate()
        if not self._free:
            self._reclaim(step_seqs)
        row = self._free.pop()
        self._row_of[seq.seq_id] = row
        self._owner[row] = seq
        return row

    def _reclaim(self, step_seqs: list) -> None:
        live = {s.seq_id for s in self._batch_seqs} | {s.seq_id for s in step_seqs}
        for row in range(1, self.num_rows):
            seq = self._owner[row]
            if seq is not None and (seq.is_finished or seq.seq_id not in live):
                del self._row_of[seq.seq_id]
                self._owner[row] = None
                self._free.append(row)
        self.epoch += 1
        if not self._free:
            raise SamplingStateError(
                f"no free sampling-state row: {self.num_rows - 1} rows all held by the "
                "current batch; the batch holds more sequences than max_num_seqs"
            )

    def device_bytes(self) -> int:
        """What the state's tensors take once allocated (at the first request that needs
        them), and the sampling pass's largest per-step buffers at max_num_seqs rows (the
        processed logits of a sampling step, fp32, and the logit statistics): reserved
        before the KV cache is sized from free memory, so that the first request with
        penalties cannot run the device out of memory."""
        rows, vocab = self.num_rows, self.vocab_size
        num_blocks = -(-vocab // kernels.BLOCK)
        persistent = rows * vocab * 4 + rows * (num_blocks + 1) * 4 + rows * (3 + 4 + 3) * 4
        per_step = (rows - 1) * vocab * 4 + (rows - 1) * (-(-vocab // 32) + 2 * num_blocks) * 4
        return persistent + per_step

    def _allocate(self) -> None:
        rows, device = self.num_rows, self.device
        self.counts = torch.zeros(rows, self.vocab_size, dtype=torch.int32, device=device)
        self.row_floats = torch.zeros(rows, 3, dtype=torch.float32, device=device)
        self.row_floats[:, 2] = 1.0
        self.row_ints = torch.zeros(rows, 4, dtype=torch.int32, device=device)
        self.bias_tokens = torch.full((rows, 1), NO_TOKEN, dtype=torch.int32, device=device)
        num_blocks = -(-self.vocab_size // kernels.BLOCK)
        self.bias_start = torch.zeros(rows, num_blocks + 1, dtype=torch.int32, device=device)
        self._block_edges = torch.arange(num_blocks + 1, dtype=torch.int32, device=device)
        self._block_edges *= kernels.BLOCK
        self.bias_values = torch.zeros(rows, 1, dtype=torch.float32, device=device)
        self.stop_ids = torch.zeros(rows, 1, dtype=torch.int32, device=device)

    def stage_builds(self, seqs: list, views) -> StagedBuilds | None:
        """Stage the builds of `seqs` (their rows assigned by `rows_for`).

        `views(rows, entries)` returns numpy views ints [rows, 5], floats [rows, 3],
        entries [entries, 3] (row, column, token) and values [entries], or None when they
        do not fit (then None is returned and `build_tensors` makes them directly)."""
        if not seqs:
            return StagedBuilds(0, 0, 0, 0, 0)
        # Checked per request before anything is written: a bad row fails its request
        # alone (failures.py), never an index out of the vocabulary on the device.
        guard_each("the sampling-state setup", [(seq,) for seq in seqs], self._check_row)
        prompts, outputs, biases, stops = [], [], [], []
        for seq in seqs:
            p = seq.sampling_params
            prompts.append(seq.token_ids[: seq.num_prompt_tokens] if p.repetition_penalty != 1.0 else ())  # fmt: skip
            outputs.append(seq.token_ids[seq.num_prompt_tokens :])
            biases.append(p.logit_bias or {})
            stops.append(p.all_stop_token_ids if p.min_tokens else ())
        sizes = [sum(len(x) for x in group) for group in (prompts, outputs, biases, stops)]
        staged = views(len(seqs), sum(sizes))
        if staged is None:
            return None
        ints, floats, entries, values = staged
        self._ensure_widths(max(len(b) for b in biases), max(len(s) for s in stops))
        for i, seq in enumerate(seqs):
            p = seq.sampling_params
            row = self._row_of[seq.seq_id]
            ints[i] = (row, p.min_tokens, len(outputs[i]), len(biases[i]), len(stops[i]))
            floats[i] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        at = 0
        for group in (prompts, outputs):
            for seq, tokens in zip(seqs, group, strict=True):
                n = len(tokens)
                entries[at : at + n, 0] = self._row_of[seq.seq_id]
                entries[at : at + n, 1] = 0
                entries[at : at + n, 2] = tokens
                at += n
        for seq, bias in zip(seqs, biases, strict=True):
            n = len(bias)
            entries[at : at + n, 0] = self._row_of[seq.seq_id]
            entries[at : at + n, 1] = np.arange(n)
            entries[at : at + n, 2] = list(bias.keys())
            values[at : at + n] = list(bias.values())
            at += n
        for seq, ids in zip(seqs, stops, strict=True):
            n = len(ids)
            entries[at : at + n, 0] = self._row_of[seq.seq_id]
            entries[at : at + n, 1] = np.arange(n)
            entries[at : at + n, 2] = ids
            at += n
        return StagedBuilds(len(seqs), *sizes)

    def _check_row(self, seq) -> None:
        """Raise if a row of `seq` would index outside the vocabulary or hold a token
        still in flight."""
        if PLACEHOLDER_TOKEN in seq.token_ids[seq.num_prompt_tokens :]:
            raise SamplingStateError(
                f"request {seq.seq_id}: its sampling state is rebuilt while a token is "
                "still in flight"
            )
        p, vocab = seq.sampling_params, self.vocab_size
        for name, ids in (
            ("logit_bias", p.logit_bias or ()),
            ("stop_token_ids", p.all_stop_token_ids if p.min_tokens else ()),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise SamplingStateError(
                    f"request {seq.seq_id}: {name} holds token id {bad[0]}, outside the "
                    f"vocabulary [0, {vocab})"
                )

    def release(self, seq_ids) -> None:
        """Forget the rows of `seq_ids` (a failed step may have assigned them without
        building them, or counted tokens that never arrived): rebuilt when they sample."""
        for seq_id in seq_ids:
            row = self._row_of.pop(seq_id, None)
            if row is not None:
                self._owner[row] = None
                self._free.append(row)
        self.epoch += 1  # cached maps of sampling rows to state rows go stale

    def build_tensors(self, seqs: list):
        """(StagedBuilds, ints, floats, entries, values) as device tensors, for builds too
        large for the slot's staging buffers (a rare step: many long prompts at once)."""
        arrays = []

        def views(rows, entries):
            arrays.extend(
                (
                    np.zeros((rows, 5), np.int32),
                    np.zeros((rows, 3), np.float32),
                    np.zeros((entries, 3), np.int32),
                    np.zeros(entries, np.float32),
                )
            )
            return arrays

        builds = self.stage_builds(seqs, views)
        return builds, *(torch.from_numpy(a).to(self.device) for a in arrays)

    def _ensure_widths(self, bias: int, stop: int) -> None:
        if bias > self.bias_tokens.shape[1]:
            self.bias_tokens = _widen(self.bias_tokens, bias, NO_TOKEN)
            self.bias_values = _widen(self.bias_values, bias, 0)
        if stop > self.stop_ids.shape[1]:
            self.stop_ids = _widen(self.stop_ids, stop, 0)

    # -- device side -------------------------------------------------------------------------
    def apply_builds(self, builds: StagedBuilds, ints, floats, entries, values) -> None:
        """Reset the built rows and write their options and tokens (device tensors)."""
        rows = ints[:, 0].long()
        self.counts.index_fill_(0, rows, 0)
        self.row_ints.index_copy_(0, rows, ints[:, 1:5])
        self.row_floats.index_copy_(0, rows, floats)
        entries = entries.long()
        end = builds.num_prompt
        prompt = entries[:end]
        flag = torch.full((end,), kernels.PROMPT_FLAG, dtype=torch.int32, device=self.device)
        self.counts.index_put_((prompt[:, 0], prompt[:, 2]), flag)  # repeats: same value
        output = entries[end : end + builds.num_output]
        ones = torch.ones(len(output), dtype=torch.int32, device=self.device)
        self.counts.index_put_((output[:, 0], output[:, 2]), ones, accumulate=True)
        end += builds.num_output
        bias = entries[end : end + builds.num_bias]
        self.bias_tokens.index_fill_(0, rows, NO_TOKEN)
        self.bias_tokens.index_put_((bias[:, 0], bias[:, 1]), bias[:, 2].int())
        self.bias_values.index_put_((bias[:, 0], bias[:, 1]), values[end : end + builds.num_bias])
        # sorted by token, and each block's first entry: the pass visits only its own
        tokens, order = self.bias_tokens[rows].sort(dim=1)
        self.bias_tokens.index_copy_(0, rows, tokens)
        self.bias_values.index_copy_(0, rows, self.bias_values[rows].gather(1, order))
        edges = self._block_edges.expand(len(rows), -1).contiguous()
        self.bias_start.index_copy_(0, rows, torch.searchsorted(tokens, edges).int())
        end += builds.num_bias
        stop = entries[end : end + builds.num_stop]
        self.stop_ids.index_put_((stop[:, 0], stop[:, 1]), stop[:, 2].int())

    def count_sampled(self, state_rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each row's sampled token (device tensors [S]; the null row, whose options
        are neutral, is skipped)."""
        kernels.count_sampled(self.counts, self.row_ints, state_rows, tokens)

    def tables(self):
        """The kernel's state arguments (atom/kernels/sampling.py)."""
        return (
            self.counts,
            self.row_floats,
            self.row_ints,
            self.bias_start,
            self.bias_tokens,
            self.bias_values,
            self.stop_ids,
        )


def _widen(table: torch.Tensor, width: int, fill) -> torch.Tensor:
    width = 1 << (width - 1).bit_length()  # powers of two: few reallocations
    wider = torch.full((table.shape[0], width), fill, dtype=table.dtype, device=table.device)
    wider[:, : table.shape[1]] = table
    return wider

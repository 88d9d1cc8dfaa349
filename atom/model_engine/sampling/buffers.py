"""The staged buffers a SamplingPlan writes and publishes, with the publisher it uses.

Part of a runner slot's step buffers (atom/model_engine/step_buffers.py), handed to the
plan on its own: the plan stages into these and publishes through `publisher`, and never
sees the slot.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from atom.h2d.contract import StagedBuffer
from atom.h2d.publisher import Publisher
from atom.h2d.slot_buffers import BufferSpec


@dataclass(frozen=True)
class SamplingBuffers:
    # The SamplingState row of each sampling row.
    sampling_state_rows: StagedBuffer  # [rows] int32
    # Builds of state rows new this step: (row, min_tokens, outputs, bias entries, stop ids)
    # | (presence, frequency, repetition) | (row, column, token) entries of prompt, output,
    # bias and stop tokens | bias values.
    state_build_ints: StagedBuffer  # [rows, 5] int32
    state_build_floats: StagedBuffer  # [rows, 3] float32
    state_build_entries: StagedBuffer  # [entries, 3] int32
    state_build_values: StagedBuffer  # [entries] float32
    token_bitmask: StagedBuffer  # [rows, ceil(vocab / 32)] int32, grammars
    logprob_rows: StagedBuffer  # [rows] int64, sampling rows that want logprobs
    # Prompt logprobs: (hidden row, target token) pairs.
    prompt_logprob_rows: StagedBuffer  # [tokens] int64
    prompt_logprob_targets: StagedBuffer  # [tokens] int64
    publisher: Publisher

    @staticmethod
    def specs(rows: int, tokens: int, build_entries: int, vocab_size: int) -> list[BufferSpec]:
        return [
            BufferSpec("sampling_state_rows", (rows,), torch.int32, 0),
            BufferSpec("state_build_ints", (rows, 5), torch.int32, 0),
            BufferSpec("state_build_floats", (rows, 3), torch.float32, 0.0),
            BufferSpec("state_build_entries", (build_entries, 3), torch.int32, 0),
            BufferSpec("state_build_values", (build_entries,), torch.float32, 0.0),
            BufferSpec("token_bitmask", (rows, -(-vocab_size // 32)), torch.int32, -1, False),
            BufferSpec("logprob_rows", (rows,), torch.int64, 0),
            BufferSpec("prompt_logprob_rows", (tokens,), torch.int64, 0),
            BufferSpec("prompt_logprob_targets", (tokens,), torch.int64, 0),
        ]

    @classmethod
    def of(cls, staged: dict[str, StagedBuffer], publisher: Publisher) -> SamplingBuffers:
        """The sampling buffers among a slot's staged buffers (by their spec names)."""
        names = [f.name for f in fields(cls) if f.name != "publisher"]
        return cls(**{name: staged[name] for name in names}, publisher=publisher)

    def stage_builds(self, rows: int, entries: int):
        """Views for SamplingState.stage_builds: (ints, floats, entries, values), or None
        when `entries` exceeds the staging."""
        if entries > self.state_build_entries.capacity:
            return None
        stage = self.publisher.stage
        return (
            stage(self.state_build_ints, rows),
            stage(self.state_build_floats, rows),
            stage(self.state_build_entries, entries),
            stage(self.state_build_values, entries),
        )

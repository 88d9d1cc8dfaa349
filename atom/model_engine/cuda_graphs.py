"""Decode CUDA graphs, one per padded batch size, captured on a slot's fixed buffers."""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from atom.forward_context import AttentionMetadata, forward_context
from atom.fusions import Fusions
from atom.graph_capture import capture_graph


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    sizes = [s for s in sizes if s <= max_num_seqs]
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """Captured decode steps of one RunnerSlot: replay with `run(batch_size)`.

    With `greedy` (the Sampler's argmax) the graphs of up to `greedy_max_rows` rows also
    hold the greedy tokens of their logits: an all-greedy step then launches nothing after
    the replay (`greedy_tokens`). The tokens live in the graph's memory: valid until its
    next replay, which is always queued after whatever the step queued with them (the
    device-to-host copy, the next step's placeholder fill).
    """

    def __init__(
        self,
        model,
        slot,
        batch_sizes: list[int],
        fusions: Fusions | None = None,
        greedy: Callable[[torch.Tensor], torch.Tensor] | None = None,
        greedy_max_rows: int = 0,
    ):
        self.model = model
        self.slot = slot
        self.fusions = fusions or Fusions()  # captured into the graphs
        self.batch_sizes = sorted(set(batch_sizes))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.greedy = greedy
        self.greedy_max_rows = greedy_max_rows
        self.tokens: dict[int, torch.Tensor] = {}  # the greedy tokens of the smaller graphs
        self.replays = 0
        self.padded_replays = 0  # replays at a size larger than the batch (padded rows)

    def padded_size(self, batch_size: int) -> int | None:
        index = bisect.bisect_left(self.batch_sizes, batch_size)
        return self.batch_sizes[index] if index < len(self.batch_sizes) else None

    def _metadata(self, size: int) -> AttentionMetadata:
        return self.slot.backend.graph_metadata(self.slot, size)

    @torch.inference_mode()
    def capture(self) -> None:
        slot = self.slot
        # Well-defined padding everywhere: no cache writes, nothing to attend to.
        slot.buffers.slot_mapping.fill_(-1)
        slot.buffers.context_lens.device.fill_(0)
        pool = None
        for size in reversed(self.batch_sizes):
            input_ids = slot.buffers.input_ids.device[:size]
            positions = slot.buffers.positions.device[:size]
            with forward_context(self._metadata(size), self.fusions):
                self._forward_and_greedy(size, input_ids, positions)  # warm-up: compiled
                torch.cuda.synchronize()
                graph, (logits, tokens) = capture_graph(
                    lambda size=size, ids=input_ids, pos=positions: self._forward_and_greedy(
                        size, ids, pos
                    ),
                    pool=pool,
                )
            pool = graph.pool()
            self.graphs[size] = graph
            self.logits[size] = logits
            if tokens is not None:
                self.tokens[size] = tokens
        torch.cuda.synchronize()

    def _forward(self, size: int, input_ids, positions) -> torch.Tensor:
        # the backend's views (slot mapping) are derived inside the graph
        self.slot.backend.derive_views(self.slot, size, size, is_decode=True)
        return self.model.compute_logits(self.model(input_ids, positions))

    def _forward_and_greedy(self, size: int, input_ids, positions):
        logits = self._forward(size, input_ids, positions)
        if self.greedy is None or logits is None or size > self.greedy_max_rows:
            return logits, None
        return logits, self.greedy(logits)

    def greedy_tokens(self, padded_size: int, batch_size: int) -> torch.Tensor | None:
        """The greedy tokens of the last replay at `padded_size`, or None (not captured)."""
        tokens = self.tokens.get(padded_size)
        return None if tokens is None else tokens[:batch_size]

    def run(self, padded_size: int, batch_size: int) -> torch.Tensor:
        self.graphs[padded_size].replay()
        self.replays += 1
        self.padded_replays += padded_size > batch_size
        return self.logits[padded_size][:batch_size]

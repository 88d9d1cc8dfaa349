"""CUDA graphs of the verify forward: S sequences x (k + 1) tokens, at padded batch sizes.

A verify step in which every sequence drafts exactly k tokens (the common case: the draft
proposer always does, the n-gram proposer on repetitive text often) has a fixed shape, so
its forward (the varlen attention kernel with max_seqlen_q = k + 1, the MLP, the LM head
over every row) is captured once per padded batch size on the slot's fixed buffers, like
the decode graphs. The slot stages and publishes the step eagerly (at its real size) and
derives the slot mapping; before a replay at a larger size the padding rows of the
buffers the graph reads are made well-defined on the device: context lengths 0 and
cu_seqlens repeating the last value (zero-length queries: no attention work), slot
mapping -1 (no KV write). Verification (verify.py) runs eagerly on the replayed logits.
"""

from __future__ import annotations

import bisect
import logging

import torch

from atom.forward_context import AttentionMetadata, forward_context
from atom.fusions import Fusions
from atom.graph_capture import capture_graph

logger = logging.getLogger(__name__)


class VerifyGraphs:
    def __init__(
        self,
        model,
        slot,
        batch_sizes: list[int],
        num_speculative_tokens: int,
        fusions: Fusions | None = None,
    ):
        self.model = model
        self.fusions = fusions or Fusions()  # captured into the graphs
        self.slot = slot
        self.rows_per_seq = num_speculative_tokens + 1
        self.batch_sizes = sorted(set(batch_sizes))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.padded_replays = 0

    def padded_size(self, batch_size: int) -> int | None:
        index = bisect.bisect_left(self.batch_sizes, batch_size)
        if index == len(self.batch_sizes) or not self.graphs:
            return None
        return self.batch_sizes[index]

    def _metadata(self, size: int) -> AttentionMetadata:
        slot = self.slot
        tokens = size * self.rows_per_seq
        return AttentionMetadata(
            slot_mapping=slot.slot_mapping[:tokens],
            context_lens=slot.context_lens.device[:size],
            block_tables=slot.page_table.device_rows[:size],
            cu_seqlens_q=slot.cu_seqlens_q.device[: size + 1],
            max_seqlen_q=self.rows_per_seq,
            is_decode=False,
        )

    def _forward(self, size: int) -> torch.Tensor:
        tokens = size * self.rows_per_seq
        slot = self.slot
        hidden = self.model(slot.input_ids.device[:tokens], slot.positions.device[:tokens])
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        slot = self.slot
        slot.slot_mapping.fill_(-1)
        slot.context_lens.device.fill_(0)
        slot.cu_seqlens_q.device.fill_(0)
        pool = None
        try:
            for size in reversed(self.batch_sizes):
                with forward_context(self._metadata(size), self.fusions):
                    self._forward(size)  # warm-up (compiles the kernels)
                    torch.cuda.synchronize()
                    graph, logits = capture_graph(lambda size=size: self._forward(size), pool=pool)
                pool = graph.pool()
                self.graphs[size] = graph
                self.logits[size] = logits
        except RuntimeError as error:  # capture unsupported here: verify steps run eagerly
            logger.warning("verify CUDA graphs unavailable (%s); eager verify steps", error)
            torch.cuda.synchronize()
            self.graphs, self.logits = {}, {}
        torch.cuda.synchronize()

    def run(self, padded_size: int, batch_size: int) -> torch.Tensor:
        """Replay at `padded_size` after the slot's flush; logits of the real rows."""
        slot = self.slot
        tokens = batch_size * self.rows_per_seq
        if padded_size > batch_size:
            padded_tokens = padded_size * self.rows_per_seq
            slot.context_lens.device[batch_size:padded_size].fill_(0)
            slot.cu_seqlens_q.device[batch_size + 1 : padded_size + 1].fill_(tokens)
            slot.slot_mapping[tokens:padded_tokens].fill_(-1)
            self.padded_replays += 1
        self.graphs[padded_size].replay()
        self.replays += 1
        return self.logits[padded_size][:tokens]

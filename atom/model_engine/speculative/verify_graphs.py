"""CUDA graphs of short multi-token steps: S sequences x up to R tokens, padded sizes.

Two steps of speculative decoding have such a shape: the target's verify step (R = k + 1:
each sequence's last token and its drafts) and the draft model's catch-up step (R = 2:
after a verify step that kept every draft, the draft has not seen its last draft and the
bonus token). Their forward (the varlen attention kernel with max_seqlen_q = R, the MLP,
the LM head over every row) is captured once per padded batch size on the slot's fixed
buffers, like the decode graphs, over S x R token rows. The slot stages and publishes the
step eagerly (at its real size, tokens packed at the front) and derives the slot mapping;
before a replay the padding of the buffers the graph reads is made well-defined on the
device: context lengths 0 and cu_seqlens repeating the last value (zero-length queries:
no attention work), slot mapping -1 (no KV write), and the backend's own rows (GDN: state
slot -1, the scratch row). The backend gives the capture metadata
(`verify_graph_metadata`); a family whose multi-token steps read the host (V4, V4.1:
`SpeculationSupport.verify_graphs` False) has no such graphs and verifies eagerly. Token rows past the step's tokens
compute garbage that no one reads; a step whose sequences have fewer than R tokens reads
its sampled rows through the published logits indices. Sampling or verification
(verify.py) runs eagerly on the replayed logits.
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
        rows_per_seq: int,
        fusions: Fusions | None = None,
    ):
        self.model = model
        self.fusions = fusions or Fusions()  # captured into the graphs
        self.slot = slot
        self.rows_per_seq = rows_per_seq
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
        """The slot's fixed views, with the backend's own (GDN: state slots, fresh flags)."""
        return self.slot.backend.verify_graph_metadata(self.slot, size, self.rows_per_seq)

    def _forward(self, size: int) -> torch.Tensor:
        tokens = size * self.rows_per_seq
        slot = self.slot
        hidden = self.model(
            slot.buffers.input_ids.device[:tokens], slot.buffers.positions.device[:tokens]
        )
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        slot = self.slot
        slot.buffers.slot_mapping.fill_(-1)
        slot.buffers.context_lens.device.fill_(0)
        slot.buffers.cu_seqlens_q.device.fill_(0)
        slot.backend.pad_graph_rows(slot, 0, max(self.batch_sizes, default=0))
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

    def fits(self, num_seqs: int, max_tokens_per_seq: int) -> int | None:
        """The padded size a step of `num_seqs` sequences of at most `max_tokens_per_seq`
        tokens each replays at, or None (eager)."""
        if max_tokens_per_seq > self.rows_per_seq:
            return None
        return self.padded_size(num_seqs)

    def run(
        self,
        padded_size: int,
        batch_size: int,
        num_tokens: int,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay at `padded_size` after the slot's flush; logits of the sampled rows
        (`logits_indices`, or every token row of the step)."""
        slot = self.slot
        padded_tokens = padded_size * self.rows_per_seq
        if padded_size > batch_size:
            slot.buffers.context_lens.device[batch_size:padded_size].fill_(0)
            slot.buffers.cu_seqlens_q.device[batch_size + 1 : padded_size + 1].fill_(num_tokens)
            slot.backend.pad_graph_rows(slot, batch_size, padded_size)
            self.padded_replays += 1
        if padded_tokens > num_tokens:
            slot.buffers.slot_mapping[num_tokens:padded_tokens].fill_(-1)
        self.graphs[padded_size].replay()
        self.replays += 1
        logits = self.logits[padded_size][:num_tokens]
        return logits if logits_indices is None else logits[logits_indices]

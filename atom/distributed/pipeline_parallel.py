"""PipelineGroup: this rank's pipeline stage and the point-to-point traffic between stages.

The decoder layers are split into `num_stages` contiguous ranges; stage s holds layers
`layer_range(num_layers)` (the embedding on the first stage, the final norm and LM head
on the last). Global rank = stage * tp_size + tp_rank: a stage's tensor-parallel ranks
are consecutive, and each rank talks only to the rank of the same tensor-parallel index
in the next and previous stage. Every tensor-parallel rank holds the whole hidden state
after its row-parallel all-reduce, so the activations need no gather.

Traffic per micro-batch: the hidden states and the residual stream ([tokens, hidden]
each) go forward from stage s to s + 1; at the end of a step the last stage sends the
sampled token ids back to the first (rank 0 answers the engine; with asynchronous
scheduling the first stage's embedding also reads them for placeholder tokens). Shapes
are never sent: every stage prepared the same micro-batch, so it knows the token count.

Sends are asynchronous (`isend`) and kept until `wait_sends`, so a stage goes on with
its next micro-batch while the previous one travels; `wait_seconds` counts the time
a stage spent blocked in a receive (its idle time inside a step).

Imports only torch: the process groups are formed in atom/model_engine/rendezvous.py.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

ACTIVATIONS_TAG = 1
TOKENS_TAG = 2


class PipelineError(ValueError):
    """A model or a size that does not split into pipeline stages."""


def stage_layer_range(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """[start, end) of `stage`'s decoder layers; earlier stages take one extra layer each
    when the split is uneven (the last stage also runs the norm, LM head and sampler)."""
    if num_layers < num_stages:
        raise PipelineError(
            f"{num_layers} decoder layers cannot fill {num_stages} pipeline stages; choose a "
            f"pipeline_parallel_size <= {num_layers}"
        )
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


class PipelineGroup:
    """One rank's view of the pipeline. A single stage never calls torch.distributed."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
    ):
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} outside [0, {num_stages})")
        self.stage = stage
        self.num_stages = num_stages
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.device = torch.device(device)
        self.group = group  # the world of this engine's ranks (min_across)
        self._sends: list = []  # (work, tensor kept alive until the send completes)
        self.wait_seconds = 0.0

    def __repr__(self) -> str:
        return f"PipelineGroup(stage={self.stage}, num_stages={self.num_stages})"

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        return stage_layer_range(num_layers, self.stage, self.num_stages)

    def _rank_of(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    # -- activations, stage s -> s + 1 -------------------------------------------------------
    def send_activations(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Queue this micro-batch's (hidden, residual) to the next stage; returns at once."""
        peer = self._rank_of(self.stage + 1)
        for tensor in (hidden, residual):
            tensor = tensor.contiguous()
            self._sends.append((dist.isend(tensor, peer, tag=ACTIVATIONS_TAG), tensor))

    def recv_activations(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden, residual) of the next micro-batch (blocks)."""
        peer = self._rank_of(self.stage - 1)
        hidden = torch.empty((num_tokens, hidden_size), dtype=dtype, device=self.device)
        residual = torch.empty_like(hidden)
        start = time.perf_counter()
        dist.recv(hidden, peer, tag=ACTIVATIONS_TAG)
        dist.recv(residual, peer, tag=ACTIVATIONS_TAG)
        self.wait_seconds += time.perf_counter() - start
        return hidden, residual

    # -- sampled tokens, last stage -> first -------------------------------------------------
    def send_tokens_to_first(self, tokens: torch.Tensor) -> None:
        tokens = tokens.contiguous()
        self._sends.append((dist.isend(tokens, self._rank_of(0), tag=TOKENS_TAG), tokens))

    def recv_tokens_from_last(self, count: int) -> torch.Tensor:
        tokens = torch.empty(count, dtype=torch.int64, device=self.device)
        start = time.perf_counter()
        dist.recv(tokens, self._rank_of(self.num_stages - 1), tag=TOKENS_TAG)
        self.wait_seconds += time.perf_counter() - start
        return tokens

    def wait_sends(self) -> None:
        """Block until every queued send has left (their tensors may then be reused)."""
        sends, self._sends = self._sends, []
        start = time.perf_counter()
        for work, _ in sends:
            work.wait()
        self.wait_seconds += time.perf_counter() - start

    def min_across(self, value: int) -> int:
        """The smallest `value` over every rank of every stage (KV blocks all can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

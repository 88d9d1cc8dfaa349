"""The interfaces of the step chain, as protocols (structural: no base class to inherit).

    Scheduler.schedule() -> ScheduledBatch      built once by the scheduler (scheduler.py)
    StepRunner.launch(batch) -> LaunchedStep    the runner's output: tokens on their way
    LLMEngine._complete(batch, handle)          the step's outputs, built once from both

Runners: ModelRunner (one process; DraftModelRunner for a draft model) and
DistributedRunner (tensor / pipeline parallel ranks, also each data-parallel replica's);
the data-parallel front (DataParallelEngine.model_runner) offers the counters only.
Handles: StepHandle (step_handle.py) and RemoteStepHandle (distributed_runner.py).
Models: every class of atom/models/registry.py is a CausalLM for ModelRunner.
tests/model_engine/test_step_chain_structure.py checks each of them against these.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from atom.model_engine.scheduler import ScheduledBatch


@runtime_checkable
class LaunchedStep(Protocol):
    """A launched step's tokens, read once they are there."""

    def result(self) -> list:
        """The sampled tokens in sampling order (a verify step: its rows), waiting for
        the device if needed; [] on a rank that does not answer the engine."""
        ...

    def logprobs(self) -> object | None:
        """The step's StepLogprobs on the host (after `result`), or None."""
        ...


@runtime_checkable
class RunnerTotals(Protocol):
    """What /metrics and the engine's set-up read of a runner."""

    num_kvcache_blocks: int | None

    def h2d_totals(self) -> tuple[int, int]:
        """Cumulative host-to-device copies and bytes of step metadata."""
        ...


@runtime_checkable
class StepRunner(RunnerTotals, Protocol):
    """What LLMEngine calls on its runner each step."""

    # The sampling state rows of running requests, released when a step fails (None: they
    # live in the rank processes), and the state rows a speculative step restores (None:
    # the family rolls back by position, or the state lives in the rank processes).
    sampling_state: object | None
    state_snapshots: object | None

    def shutdown(self) -> None:
        """Stop what the runner started (tensor-parallel workers, the rendezvous port)."""
        ...

    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queue the forward and sampling of `batch`; does not wait for the device."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    """What ModelRunner calls on a model (an nn.Module built by its family's class)."""

    @property
    def attention_layers(self) -> list:
        """The attention layers, in order; their backend owns their KV cache."""
        ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, *intermediate):
        """Hidden states of the step's tokens (a pipeline stage that is not last:
        the activations it sends on)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

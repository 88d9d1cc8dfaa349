"""The draft model's runner: a ModelRunner for the proposer's short greedy launches.

Two things differ from the target's runner (draft_model.py says why):
- its short catch-up steps (at most `catch_up_rows` tokens per sequence) replay
  multi-token CUDA graphs (verify_graphs.py);
- its launches alternate between two runner slots, so that the host stages launch n + 1
  while launch n - 1's copies may still be in flight (a slot's producer guard waits for
  its own previous copies only). Its decode graphs therefore do not hold their greedy
  tokens: a chain reads each launch's device tokens after the next replay.
"""

from __future__ import annotations

import torch

from atom.model_engine.model_runner import ModelRunner
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.step_handle import StepHandle


class DraftModelRunner(ModelRunner):
    def __init__(self, config, hf_config, weights, max_model_len: int, catch_up_rows: int):
        self.catch_up_rows = catch_up_rows  # read by the hooks ModelRunner.__init__ calls
        self._next_slot = 0  # the slot of the next launch
        super().__init__(config, hf_config, weights, max_model_len)

    def _num_slots(self) -> int:
        return 2

    def _graphs_hold_greedy_tokens(self) -> bool:
        return False

    def _multi_token_graph_rows(self) -> int | None:
        return self.catch_up_rows

    def _replays_short_steps(self) -> bool:
        return True  # every catch-up step that fits

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> StepHandle:
        """The whole batch on the slot not used by the previous launch."""
        previous = self._last_sampled
        self.sampling_state.begin_step(batch.seqs)
        index, self._next_slot = self._next_slot, 1 - self._next_slot
        return self._handle([self._launch_part(index, batch, previous)])

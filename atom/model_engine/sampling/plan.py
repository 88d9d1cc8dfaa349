"""What a step's sampling needs beyond temperature / top-k / top-p: the SamplingPlan.

Made only when some request of the step asks for log-probabilities (sampled or prompt),
structured output, min_tokens, logit_bias or penalties; otherwise the runner samples as
before and nothing here runs. Its three phases follow the runner slot's step:

- `stage` (RunnerSlot.prepare, under the producer guard): numpy writes into its
  SamplingBuffers (sampling/buffers.py) - the map of sampling rows to SamplingState rows, the builds of rows new
  this step, the grammar bitmask, logprob and prompt-logprob rows. A decode step whose batch
  is unchanged since the slot's previous step reuses that step's plan: nothing is staged
  and nothing uploaded (the map is still in its device destination).
- `publish` (at the sampler, inside RunnerSlot.publish, before the flush): through the
  buffers' publisher.
- `sample` (after the LM head), vLLM V1's order on the device: raw log-probability
  statistics of the logits as the LM head returns them; the grammar bitmask; logit_bias,
  min_tokens and penalties in one kernel over the SamplingState (for all-greedy steps
  without a grammar the same kernel also takes the argmax, writing no logits); the
  Sampler; the sampled
  tokens counted into their state rows; the chosen tokens' log-probabilities and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from atom.kernels import sampling as kernels
from atom.model_engine.sampling.buffers import SamplingBuffers
from atom.model_engine.sampling.logprobs import LogprobTensors, StepLogprobs, compute_logprobs
from atom.model_engine.sampling.sampler import Sampler, SamplingTensors
from atom.model_engine.sampling.state import SamplingState, StagedBuilds
from atom.model_engine.sampling.structured_output import apply_token_bitmask, fill_bitmask


@dataclass
class SamplingPlan:
    num_rows: int  # sampling rows of the step
    state: SamplingState | None  # None: no row processes its logits
    builds: StagedBuilds | None  # state rows built this step (staged in the buffers)
    fallback_builds: tuple | None  # (builds, ints, floats, entries, values) on the device
    structured: bool  # the bitmask is staged
    logprob_rows: list[int]  # sampling rows that want logprobs
    logprob_k: list[int]
    all_rows_logprobs: bool  # every sampling row wants them (no index published)
    prompt_spans: list[tuple[object, int, int, int]]
    prompt_token_ids: list[int]
    # Device views, set by `publish`:
    state_rows: torch.Tensor | None = None  # [S] int32
    build_tensors: tuple | None = None  # ints, floats, entries, values
    bitmask: torch.Tensor | None = None  # [S, W] int32
    logprob_index: torch.Tensor | None = None  # [R] int64
    prompt_indices: torch.Tensor | None = None  # token rows of the step's hidden states
    prompt_targets: torch.Tensor | None = None  # the prompt token each of them predicts

    # -- host: staging ----------------------------------------------------------------------
    @classmethod
    def stage(
        cls,
        buffers: SamplingBuffers,
        state: SamplingState,
        batch,
        sampling_seqs: list,
        cu: np.ndarray,
        ends: np.ndarray,
    ):
        """Stage the plan of `batch` in `buffers` (inside the slot's producer guard); None
        when no request of the step needs one."""
        seqs = batch.seqs
        if batch.needs_sampling_plan is False or not any(
            s.sampling_params.needs_sampling_plan for s in seqs
        ):
            return None
        stage, n = buffers.publisher.stage, len(sampling_seqs)
        params = [s.sampling_params for s in sampling_seqs]
        builds = fallback = None
        processes = any(p.processes_logits for p in params)
        if processes:
            built = state.rows_for(sampling_seqs, stage(buffers.sampling_state_rows, n))
            if built:
                builds = state.stage_builds(built, buffers.stage_builds)
                if builds is None:  # too large for the staging: made directly
                    fallback = state.build_tensors(built)
        structured = any(getattr(s, "grammar", None) is not None for s in sampling_seqs)
        if structured:
            fill_bitmask(sampling_seqs, stage(buffers.token_bitmask, n))
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        all_rows = len(rows) == n
        if rows and not all_rows:
            stage(buffers.logprob_rows, len(rows))[:] = rows

        spans, hidden_rows, targets = [], [], []
        for row, seq in enumerate(seqs):
            k = seq.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = seq.num_computed_tokens
            count = min(int(ends[row]), seq.num_prompt_tokens - 1) - start
            if count <= 0:
                continue
            spans.append((seq, start + 1, count, k))
            hidden_rows.extend(range(int(cu[row]), int(cu[row]) + count))
            targets.extend(seq.token_ids[start + 1 : start + 1 + count])
        if spans:
            stage(buffers.prompt_logprob_rows, len(hidden_rows))[:] = hidden_rows
            stage(buffers.prompt_logprob_targets, len(targets))[:] = targets
        return cls(
            n,
            state if processes else None,
            builds,
            fallback,
            structured,
            rows,
            [params[i].logprobs for i in rows],
            all_rows,
            spans,
            targets,
        )

    @property
    def reusable(self) -> bool:
        """An unchanged decode batch may run this plan again with nothing staged."""
        return not self.structured and not self.prompt_spans

    def again(self) -> SamplingPlan:
        """This plan for the next step of the same batch: its rows are built, its map and
        logprob rows are still in their device destinations."""
        return replace(self, builds=None, fallback_builds=None, build_tensors=None)

    # -- publication at the sampler ---------------------------------------------------------
    def publish(self, buffers: SamplingBuffers) -> None:
        publish = buffers.publisher.publish
        if self.state is not None and self.state_rows is None:
            self.state_rows = publish(buffers.sampling_state_rows, self.num_rows)
        if self.builds is not None and self.builds.rows:
            b = self.builds
            self.build_tensors = (
                publish(buffers.state_build_ints, b.rows),
                publish(buffers.state_build_floats, b.rows),
                publish(buffers.state_build_entries, b.num_entries),
                publish(buffers.state_build_values, b.num_entries),
            )
        if self.structured:
            self.bitmask = publish(buffers.token_bitmask, self.num_rows)
        if self.logprob_rows and not self.all_rows_logprobs and self.logprob_index is None:
            self.logprob_index = publish(buffers.logprob_rows, len(self.logprob_rows))
        if self.prompt_spans:
            count = len(self.prompt_token_ids)
            self.prompt_indices = publish(buffers.prompt_logprob_rows, count)
            self.prompt_targets = publish(buffers.prompt_logprob_targets, count)

    # -- device -----------------------------------------------------------------------------
    @property
    def has_prompt_logprobs(self) -> bool:
        return bool(self.prompt_spans)

    def prompt_logprobs(self, model, hidden: torch.Tensor):
        """LogprobTensors of the prompt spans, from the step's hidden states [T, H]."""
        if not self.prompt_spans:
            return None
        logits = model.compute_logits(hidden[self.prompt_indices])
        k = max(k for *_, k in self.prompt_spans)
        return compute_logprobs(logits, self.prompt_targets, k)

    def sample(
        self, sampler: Sampler, logits: torch.Tensor, params: SamplingTensors, prompt=None
    ) -> tuple[torch.Tensor, StepLogprobs | None]:
        """Tokens [S] and the step's log-probabilities (None if nobody asked)."""
        ops = _KERNELS if logits.is_cuda else _REFERENCES
        rows = stats = None
        if self.logprob_rows:
            rows = self.logprob_index
            if rows is None:  # every row: kept for the steps that reuse this plan
                rows = self.logprob_index = torch.arange(self.num_rows, device=logits.device)
            k = max(self.logprob_k)
        state = self.state
        if state is not None:
            if self.build_tensors is not None:
                state.apply_builds(self.builds, *self.build_tensors)
            elif self.fallback_builds is not None:
                state.apply_builds(*self.fallback_builds)
        if state is not None and params.all_greedy and self.bitmask is None:
            # nothing written; the raw logits' statistics from the same pass
            if rows is None:
                tokens = ops.greedy(logits, self.state_rows, *state.tables())
            else:
                tokens, stats = ops.greedy(logits, self.state_rows, *state.tables(), stats=True)
                lse, top_values, top_ids = ops.candidates(logits, rows, k, stats=stats)
        else:
            if rows is not None:  # before the sampler, which may scale fp32 logits in place
                lse, top_values, top_ids = ops.candidates(logits, rows, k)
            if state is not None:
                processed = ops.options(logits, self.state_rows, *state.tables())
            else:
                processed = logits.float()
                if self.bitmask is not None and processed.data_ptr() == logits.data_ptr():
                    processed = processed.clone()  # the raw logits stay for the ranks
            if self.bitmask is not None:
                processed = apply_token_bitmask(processed, self.bitmask)
            tokens = sampler(processed, params)
        if state is not None:
            state.count_sampled(self.state_rows, tokens)
        sample = None
        if rows is not None:
            chosen_tokens = tokens if self.all_rows_logprobs else tokens[rows]
            chosen = logits[rows, chosen_tokens].float()
            ranks = ops.count_greater(logits, rows, chosen) + 1
            sample = LogprobTensors(chosen - lse, ranks, top_ids, top_values - lse.unsqueeze(1))
        return tokens, self.step_logprobs(sample, prompt)

    def step_logprobs(self, sample, prompt) -> StepLogprobs | None:
        if sample is None and prompt is None:
            return None
        return StepLogprobs(
            self.logprob_rows, self.logprob_k, sample, self.prompt_spans, self.prompt_token_ids, prompt
        )  # fmt: skip


@dataclass(frozen=True)
class _Ops:
    options: object
    greedy: object
    candidates: object
    count_greater: object


# The engine runs the Triton kernels on CUDA and their torch references on CPU.
_KERNELS = _Ops(
    kernels.apply_sampling_options,
    kernels.greedy_with_sampling_options,
    kernels.logprob_candidates,
    kernels.count_greater,
)


def _greedy_reference(logits, state_rows, *tables, stats: bool = False):
    tokens = kernels.greedy_with_sampling_options_reference(logits, state_rows, *tables)
    return (tokens, None) if stats else tokens


def _candidates_reference(logits, row_ids, k, stats=None):
    return kernels.logprob_candidates_reference(logits, row_ids, k)


_REFERENCES = _Ops(
    kernels.apply_sampling_options_reference,
    _greedy_reference,
    _candidates_reference,
    kernels.count_greater_reference,
)

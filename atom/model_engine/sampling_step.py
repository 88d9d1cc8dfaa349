"""What a step's sampling needs beyond temperature / top-k / top-p: the SamplingPlan.

Built on the host from the scheduled batch only when some request of the step asks for
log-probabilities (sampled or prompt), structured output, min_tokens, logit_bias or
penalties; otherwise the runner samples as before and nothing here runs. Its device
work, in order (vLLM V1's): raw log-probabilities of the logits as the LM head returns
them; the grammar bitmask; min_tokens and logit_bias; penalties; then the Sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from atom.model_engine.logits_processors import LogitsInputs, apply_logits_processors
from atom.model_engine.logprobs import StepLogprobs, compute_logprobs, gather_logprobs
from atom.model_engine.sampler import Sampler, SamplingTensors
from atom.model_engine.structured_output import apply_token_bitmask, fill_bitmask


@dataclass
class SamplingPlan:
    logits_inputs: LogitsInputs | None
    bitmask: torch.Tensor | None  # [S, W] int32
    logprob_rows: list[int]  # sampling rows that want logprobs
    logprob_k: list[int]
    logprob_index: torch.Tensor | None  # the same rows on the device; None = every row
    prompt_indices: torch.Tensor | None  # token rows of the step's hidden states
    prompt_targets: torch.Tensor | None  # the prompt token each of them predicts
    prompt_spans: list[tuple[object, int, int, int]]
    prompt_token_ids: list[int]

    @classmethod
    def build(cls, batch, sampling_seqs: list, vocab_size: int, device) -> SamplingPlan | None:
        seqs = batch.seqs
        if batch.needs_sampling_plan is False or not any(
            s.sampling_params.needs_sampling_plan for s in seqs
        ):
            return None
        num_new = np.asarray(batch.num_new_tokens, dtype=np.int64)
        cu = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        # Index in the step's input ids of each sampling row's last input token.
        ends = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs)) + num_new
        lengths = np.fromiter((len(s.token_ids) for s in seqs), np.int64, len(seqs))
        input_rows = cu[np.flatnonzero(ends == lengths) + 1] - 1

        logits_inputs = LogitsInputs.build(sampling_seqs, input_rows, vocab_size, device)
        bitmask = fill_bitmask(sampling_seqs, vocab_size)
        if bitmask is not None:
            bitmask = _upload(torch.from_numpy(bitmask), device)
        rows = [i for i, s in enumerate(sampling_seqs) if s.sampling_params.logprobs is not None]
        ks = [sampling_seqs[i].sampling_params.logprobs for i in rows]
        index = None
        if rows and len(rows) != len(sampling_seqs):
            index = _upload(torch.tensor(rows, dtype=torch.int64), device)

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
        prompt_indices = prompt_targets = None
        if spans:
            prompt_indices = _upload(torch.tensor(hidden_rows, dtype=torch.int64), device)
            prompt_targets = _upload(torch.tensor(targets, dtype=torch.int64), device)
        return cls(
            logits_inputs, bitmask, rows, ks, index, prompt_indices, prompt_targets, spans, targets
        )

    @property
    def has_prompt_logprobs(self) -> bool:
        return self.prompt_indices is not None

    def prompt_logprobs(self, model, hidden: torch.Tensor):
        """LogprobTensors of the prompt spans, from the step's hidden states [T, H]."""
        if self.prompt_indices is None:
            return None
        logits = model.compute_logits(hidden[self.prompt_indices])
        k = max(k for *_, k in self.prompt_spans)
        return compute_logprobs(logits, self.prompt_targets, k)

    def sample(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        params: SamplingTensors,
        input_ids: torch.Tensor | None,
        prompt=None,
    ) -> tuple[torch.Tensor, StepLogprobs | None]:
        """Tokens [S] and the step's log-probabilities (None if nobody asked)."""
        logprobs = None
        if self.logprob_rows:
            raw = logits if self.logprob_index is None else logits[self.logprob_index]
            logprobs = raw.float().log_softmax(dim=-1)  # a new tensor: later ops keep it
        logits = logits.float()
        if self.bitmask is not None:
            logits = apply_token_bitmask(logits, self.bitmask)
        if self.logits_inputs is not None:
            logits = apply_logits_processors(logits, self.logits_inputs, input_ids)
        tokens = sampler(logits, params)
        sample = None
        if logprobs is not None:
            chosen = tokens if self.logprob_index is None else tokens[self.logprob_index]
            sample = gather_logprobs(logprobs, chosen, max(self.logprob_k))
        return tokens, self.step_logprobs(sample, prompt)

    def step_logprobs(self, sample, prompt) -> StepLogprobs | None:
        if sample is None and prompt is None:
            return None
        return StepLogprobs(
            self.logprob_rows, self.logprob_k, sample, self.prompt_spans, self.prompt_token_ids, prompt
        )  # fmt: skip


def _upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)

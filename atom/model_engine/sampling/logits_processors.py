"""min_tokens, logit_bias and penalties as vLLM defines them: the torch reference.

The engine applies them with one Triton kernel over the device-resident SamplingState
(atom/kernels/sampling.py, atom/model_engine/sampling/state.py); this module is the
independent reference that kernel is tested against: rebuilt from host token lists, a
few batched tensor ops, in vLLM V1's order - min_tokens (end-of-sequence and stop ids at
-inf while a request has fewer output tokens than its minimum) and logit_bias (added)
first, then the penalties of `apply_penalties`:

    seen    = token in the prompt or the output so far
    logits  = where(seen, logits > 0 ? logits / repetition : logits * repetition, logits)
    logits -= frequency_penalty * (count of the token in the output)
    logits -= presence_penalty * (token in the output)

Output token lists are padded with `vocab_size` (a dummy column dropped after counting).
A placeholder last output token (asynchronous scheduling) is read from the step's input
ids on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from atom.model_engine.sequence import PLACEHOLDER_TOKEN


@dataclass
class LogitsInputs:
    """One step's logits-processing tensors on the device; rows = sampling rows."""

    # (row, token) pairs set to -inf: requests below their min_tokens
    mask_rows: torch.Tensor | None
    mask_tokens: torch.Tensor | None
    # (row, token, bias) triples of logit_bias
    bias_rows: torch.Tensor | None
    bias_tokens: torch.Tensor | None
    bias_values: torch.Tensor | None
    # penalties: [S] float32 each, or None when no row has any
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    output_tokens: torch.Tensor | None = None  # [S, L] int64, padded with vocab_size
    prompt_tokens: torch.Tensor | None = None  # [S, P] int64 (repetition penalty only)
    # placeholder fix-ups: output_tokens[fix_rows, fix_cols] = input_ids[fix_src]
    fix_rows: torch.Tensor | None = None
    fix_cols: torch.Tensor | None = None
    fix_src: torch.Tensor | None = None

    @classmethod
    def build(
        cls, seqs: list, input_rows: np.ndarray | None, vocab_size: int, device: torch.device
    ) -> LogitsInputs | None:
        """From the step's sampling sequences (row order); None when none needs it.

        `input_rows[i]`: index in the step's input ids of sampling row i's last input
        token (where a placeholder's value lands); needed only with placeholders.
        """
        params = [s.sampling_params for s in seqs]
        if not any(p.processes_logits for p in params):
            return None
        upload = _Uploader(device)
        mask_rows, mask_tokens = [], []
        bias_rows, bias_tokens, bias_values = [], [], []
        for row, (seq, p) in enumerate(zip(seqs, params, strict=True)):
            if p.min_tokens and len(seq.token_ids) - seq.num_prompt_tokens < p.min_tokens:
                stops = p.all_stop_token_ids
                mask_rows += [row] * len(stops)
                mask_tokens += stops
            if p.logit_bias:
                bias_rows += [row] * len(p.logit_bias)
                bias_tokens += p.logit_bias.keys()
                bias_values += p.logit_bias.values()
        inputs = cls(
            upload.ints(mask_rows),
            upload.ints(mask_tokens),
            upload.ints(bias_rows),
            upload.ints(bias_tokens),
            upload.floats(bias_values),
        )
        if any(p.has_penalties for p in params):
            inputs._add_penalties(seqs, params, input_rows, vocab_size, upload)
        return inputs

    def _add_penalties(self, seqs, params, input_rows, vocab_size: int, upload) -> None:
        n = len(seqs)
        outputs = [s.token_ids[s.num_prompt_tokens :] if p.has_penalties else [] for s, p in zip(seqs, params, strict=True)]  # fmt: skip
        width = max(1, max(len(o) for o in outputs))
        tokens = np.full((n, width), vocab_size, dtype=np.int64)
        fix_rows, fix_cols = [], []
        for row, output in enumerate(outputs):
            if output:
                tokens[row, : len(output)] = output
                if output[-1] == PLACEHOLDER_TOKEN:
                    fix_rows.append(row)
                    fix_cols.append(len(output) - 1)
        tokens[tokens == PLACEHOLDER_TOKEN] = vocab_size
        self.output_tokens = upload.array(tokens)
        if fix_rows:
            assert input_rows is not None, "placeholders need the input rows"
            self.fix_rows = upload.ints(fix_rows)
            self.fix_cols = upload.ints(fix_cols)
            self.fix_src = upload.ints(input_rows[fix_rows].tolist())
        self.presence = upload.floats([p.presence_penalty for p in params])
        self.frequency = upload.floats([p.frequency_penalty for p in params])
        if any(p.repetition_penalty != 1.0 for p in params):
            prompts = [
                s.token_ids[: s.num_prompt_tokens] if p.repetition_penalty != 1.0 else []
                for s, p in zip(seqs, params, strict=True)
            ]
            width = max(1, max(len(t) for t in prompts))
            prompt = np.full((n, width), vocab_size, dtype=np.int64)
            for row, ids in enumerate(prompts):
                prompt[row, : len(ids)] = ids
            self.prompt_tokens = upload.array(prompt)
            self.repetition = upload.floats([p.repetition_penalty for p in params])


class _Uploader:
    """Host lists -> device tensors (pinned, non-blocking on CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device

    def array(self, values: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(values)
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def ints(self, values) -> torch.Tensor | None:
        return self.array(np.asarray(values, dtype=np.int64)) if len(values) else None

    def floats(self, values) -> torch.Tensor | None:
        return self.array(np.asarray(values, dtype=np.float32)) if len(values) else None


def apply_logits_processors(
    logits: torch.Tensor, inputs: LogitsInputs, input_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [S, V] float32 (modified in place and returned) after min_tokens,
    logit_bias and penalties. `input_ids`: the step's device input ids (placeholders)."""
    if inputs.mask_rows is not None:
        logits.index_put_((inputs.mask_rows, inputs.mask_tokens), _NEG_INF(logits))
    if inputs.bias_rows is not None:
        logits.index_put_(
            (inputs.bias_rows, inputs.bias_tokens), inputs.bias_values, accumulate=True
        )
    if inputs.output_tokens is not None:
        output_tokens = inputs.output_tokens
        if inputs.fix_rows is not None:
            output_tokens[inputs.fix_rows, inputs.fix_cols] = input_ids[inputs.fix_src]
        logits = apply_penalties(
            logits,
            output_tokens,
            inputs.prompt_tokens,
            inputs.presence,
            inputs.frequency,
            inputs.repetition,
        )
    return logits


def _NEG_INF(logits: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)


def token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, L] token ids padded with vocab_size -> [S, V + 1] occurrence counts (float32;
    the last column counts the padding)."""
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.float32, device=tokens.device)
    return counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float32))


def apply_penalties(
    logits: torch.Tensor,
    output_tokens: torch.Tensor,
    prompt_tokens: torch.Tensor | None,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor | None,
) -> torch.Tensor:
    """vLLM's repetition, frequency and presence penalties, batched over rows.

    Only the logits of tokens a row has seen change, so they are gathered at those
    tokens ([S, P + L], small beside [S, V]), penalised and scattered back: the one
    pass over [S, V] is the zeroing of the output-token counts. A token listed twice
    computes the same value twice (same logit, same count), so the scatter is
    deterministic; padding entries point at their row's first real token (or, in a row
    without any, at token 0 with nothing to apply).
    """
    vocab = logits.shape[1]
    counts = token_counts(output_tokens, vocab)
    tokens = (
        output_tokens if prompt_tokens is None else torch.cat([prompt_tokens, output_tokens], 1)
    )
    real = tokens != vocab
    first = tokens.gather(1, real.to(torch.int8).argmax(dim=1, keepdim=True))
    has_any = real.any(dim=1, keepdim=True)
    index = torch.where(has_any, torch.where(real, tokens, first), 0)
    values = logits.gather(1, index)
    seen_counts = counts.gather(1, index)
    if repetition is not None:
        factor = repetition.unsqueeze(1)
        penalised = torch.where(values > 0, values / factor, values * factor)
        values = torch.where(has_any, penalised, values)
    values = values - frequency.unsqueeze(1) * seen_counts
    values = values - presence.unsqueeze(1) * (seen_counts > 0)
    return logits.scatter_(1, index, values)

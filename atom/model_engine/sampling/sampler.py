"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Random sampling uses the exponential race (argmax of p / Exp(1)), which equals sampling
from p; each seeded request draws its noise from its own generator, so its tokens do not
depend on the batch it lands in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.kernels.argmax import chunked_argmax_cpu, greedy_argmax


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, on the logits' device.

    `all_greedy` short-cuts to argmax; `temperatures` etc. are None in that case.
    `generators[i]` is the seeded generator of row i, or None.
    """

    all_greedy: bool
    temperature: float | None = None  # one temperature for every row: stays on the host
    temperatures: torch.Tensor | None = None  # [S] float32, 0 = greedy row
    top_k: torch.Tensor | None = None  # [S] int64, vocab size = disabled
    top_p: torch.Tensor | None = None  # [S] float32
    needs_top_k: bool = False
    needs_top_p: bool = False
    generators: list[torch.Generator | None] | None = None


# The most rows the two-stage argmax takes: it wins where few rows leave most of the GPU idle
# (docs/benchmarks.md); a large batch already fills the GPU with torch's one row per program.
ARGMAX_MAX_ROWS = 16


class Sampler:
    def __init__(self, greedy_argmax: bool = False):
        # Fusions.greedy_argmax: greedy rows through the two-stage Triton argmax on CUDA
        # (atom/kernels/argmax.py; the same tokens, ties to the lowest index), for up to
        # ARGMAX_MAX_ROWS rows.
        self.greedy_argmax = greedy_argmax

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if (
            self.greedy_argmax
            and logits.is_cuda
            and logits.stride(-1) == 1
            and logits.shape[0] <= ARGMAX_MAX_ROWS
        ):
            return greedy_argmax(logits)
        if logits.device.type == "cpu":
            return chunked_argmax_cpu(logits)
        return logits.argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        """logits [S, V] -> token ids [S] (int64)."""
        if params.all_greedy:
            return self.argmax(logits)
        probs = target_probs(logits, params)
        noise = torch.empty_like(probs).exponential_()
        if params.generators is not None:
            for row, generator in enumerate(params.generators):
                if generator is not None:
                    noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        if params.temperatures is None:  # uniform temperature > 0: no greedy rows
            return sampled
        greedy = self.argmax(logits.float())
        return torch.where(params.temperatures > 0, sampled, greedy)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None):
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        # keep the last k of the ascending order
        kth = (vocab - top_k.clamp(1, vocab)).unsqueeze(1)
        threshold = sorted_logits.gather(1, kth)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def target_probs(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """[R, V] float32: the distribution the sampler draws from at each row (temperature,
    top-k, top-p; also the target distribution of speculative verification)."""
    logits = logits.float()
    temps = params.temperatures
    if temps is None:
        scaled = logits / params.temperature
    else:
        scaled = logits / torch.where(temps > 0, temps, 1.0).unsqueeze(1)
    if params.needs_top_k or params.needs_top_p:
        scaled = apply_top_k_top_p(
            scaled,
            params.top_k if params.needs_top_k else None,
            params.top_p if params.needs_top_p else None,
        )
    return scaled.softmax(dim=-1)

"""The handle of a launched step: its sampled tokens, copied to the host without blocking."""

from __future__ import annotations

import torch

from atom.model_engine.logprobs import StepLogprobs


class StepHandle:
    """Sampled tokens of a launched step, copied to the host without blocking."""

    def __init__(
        self,
        host_tokens: torch.Tensor | None,
        done: torch.cuda.Event | None,
        logprobs: StepLogprobs | None = None,
        device_tokens: torch.Tensor | None = None,
    ):
        self._tokens = host_tokens
        self._done = done
        self._logprobs = logprobs
        # the sampled tokens where the step left them (a draft chain feeds them on); for
        # graph-held greedy tokens (DecodeGraphs) valid until that graph's next replay
        self.device_tokens = device_tokens

    @classmethod
    def of(cls, tokens: torch.Tensor, logprobs: StepLogprobs | None = None) -> StepHandle:
        if not tokens.is_cuda:
            return cls(tokens, None, logprobs, tokens)
        host = tokens.to("cpu", non_blocking=True)
        if logprobs is not None:
            logprobs = logprobs.to_host()
        done = torch.cuda.Event()
        done.record()
        return cls(host, done, logprobs, tokens)

    def result(self) -> list[int]:
        if self._done is not None:
            self._done.synchronize()
        return [] if self._tokens is None else self._tokens.tolist()

    def logprobs(self) -> StepLogprobs | None:
        """The step's log-probabilities on the host (after `result`), or None."""
        if self._logprobs is not None and self._tokens is None:  # prompt-only step
            return self._logprobs.to_host(non_blocking=False)
        return self._logprobs

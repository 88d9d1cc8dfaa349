"""The handle of a launched step: its sampled tokens, copied to the host without blocking."""

from __future__ import annotations

import torch

from atom.h2d.publisher import stream_id_reader
from atom.model_engine.sampling.logprobs import StepLogprobs


class _HostTokens:
    """One pinned host buffer (int64) and the event of the copy into it."""

    def __init__(self):
        self.host: torch.Tensor | None = None
        self.views: dict[tuple, torch.Tensor] = {}
        self.event = torch.cuda.Event()

    def view(self, shape: tuple, numel: int) -> torch.Tensor:
        if self.host is None or self.host.numel() < numel:  # first use or larger: grow
            size = max(64, 1 << max(numel - 1, 0).bit_length())
            self.host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self.views.clear()
        view = self.views.get(shape)
        if view is None:
            view = self.views[shape] = self.host[:numel].view(shape)
        return view


class HostTokenPool:
    """Pinned buffers and events for the tokens a runner's steps copy back to the host.

    A step takes a free entry, its handle gives it back once read (or dropped), so no
    step pays for a pinned allocation (torch's caching host allocator) or a new Event:
    its copy and event record cost what the copy itself costs. The pool holds as many
    entries as there are handles unread at once (two with asynchronous scheduling; a
    draft model's chain holds one per launch until it reads them).
    """

    def __init__(self, device: torch.device):
        self._free: list[_HostTokens] = []
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self._stream = torch.cuda.current_stream(device)
        self._stream_id = self._stream.stream_id
        self._current_id = stream_id_reader(device)  # cheaper than current_stream()

    def copy(self, tokens: torch.Tensor) -> tuple[_HostTokens, torch.Tensor]:
        """Queue the copy of `tokens` (int64) into a free entry: (entry, its host view)."""
        entry = self._free.pop() if self._free else _HostTokens()
        view = entry.view(tuple(tokens.shape), tokens.numel())
        view.copy_(tokens, non_blocking=True)
        return entry, view

    def record(self, entry: _HostTokens) -> torch.cuda.Event:
        """Record the entry's event on the current stream (after every copy it covers)."""
        if self._current_id() != self._stream_id:
            self._stream = torch.cuda.current_stream(self._device)
            self._stream_id = self._stream.stream_id
        entry.event.record(self._stream)
        return entry.event

    def release(self, entry: _HostTokens) -> None:
        self._free.append(entry)


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
        self._pooled: tuple[HostTokenPool, _HostTokens] | None = None
        self._list: list | None = None  # the tokens, once read out of a pooled buffer
        # the sampled tokens where the step left them (a draft chain feeds them on); for
        # graph-held greedy tokens (DecodeGraphs) valid until that graph's next replay
        self.device_tokens = device_tokens

    @classmethod
    def of(
        cls,
        tokens: torch.Tensor,
        logprobs: StepLogprobs | None = None,
        pool: HostTokenPool | None = None,
    ) -> StepHandle:
        if not tokens.is_cuda:
            return cls(tokens, None, logprobs, tokens)
        entry = None
        if pool is not None and tokens.dtype == torch.int64:
            entry, host = pool.copy(tokens)
        else:
            host = tokens.to("cpu", non_blocking=True)
        if logprobs is not None:
            logprobs = logprobs.to_host()
        if entry is None:
            done = torch.cuda.Event()
            done.record()
            return cls(host, done, logprobs, tokens)
        handle = cls(host, pool.record(entry), logprobs, tokens)  # after every copy above
        handle._pooled = (pool, entry)
        return handle

    def result(self) -> list[int]:
        if self._done is not None:
            self._done.synchronize()
        if self._tokens is None:
            return []
        if self._list is not None:  # read before: the pooled buffer went back
            return list(self._list)
        tokens = self._tokens.tolist()
        if self._pooled is not None:
            self._list = tokens
            self._release()
            return list(tokens)
        return tokens

    def _release(self) -> None:
        pooled, self._pooled = self._pooled, None
        if pooled is not None:
            pooled[0].release(pooled[1])

    def __del__(self):
        # dropped unread: a later copy into the entry is queued after this one's
        self._release()

    def logprobs(self) -> StepLogprobs | None:
        """The step's log-probabilities on the host (after `result`), or None."""
        if self._logprobs is not None and self._tokens is None:  # prompt-only step
            return self._logprobs.to_host(non_blocking=False)
        return self._logprobs

"""Failure containment: which exceptions of a step belong to one request, which end the engine.

The contract (docs/architecture.md, "Failure containment"):

- A per-request stage (sampling-state setup, a grammar matcher, the server's detokenizer)
  runs under a guard that names the request: its exception fails that request alone
  (`RequestFailed`).
- A batch-wide stage (the model forward, the sampler) cannot name one: the engine retries
  the step's requests in halves (bisection) until the one whose presence makes the step
  fail is alone; that one fails, the others finish with the tokens they would have had.
- A device fault (a CUDA error, a lost tensor-parallel rank) may have corrupted memory
  every request shares: it stops the engine (`is_device_fault`).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_MAX_DETAIL = 300  # characters of an exception's message in a log line

# Substrings of a RuntimeError's message that mean the device (or its library) failed.
_DEVICE_MARKERS = (
    "CUDA error",
    "CUDA driver",
    "device-side assert",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "NCCL",
    "illegal memory access",
    "HIP error",
)


class RequestFailed(Exception):
    """A per-request stage failed: `seq_ids` are the requests to fail, `cause` why."""

    def __init__(self, seq_ids: list[int], stage: str, cause: BaseException):
        super().__init__(f"{stage} failed for request(s) {seq_ids}: {describe(cause)}")
        self.seq_ids = list(seq_ids)
        self.stage = stage
        self.cause = cause


def describe(error: BaseException) -> str:
    """`Type: message`, shortened, for the log."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _MAX_DETAIL else text[: _MAX_DETAIL - 3] + "..."


def client_message(stage: str, error: BaseException) -> str:
    """What the failed request's client is told: the stage and the exception's type,
    not its message (it may hold internals) and never a traceback; the log has both."""
    return f"{stage} failed ({type(error).__name__})"


def is_device_fault(error: BaseException) -> bool:
    """Whether `error` means the device or a rank failed (the engine must stop)."""
    from atom.model_engine.workers import WorkerFailedError  # it imports the runner

    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None and isinstance(error, accelerator):
        return True
    if isinstance(error, WorkerFailedError):
        return True
    if isinstance(error, RuntimeError):
        message = str(error)
        return any(marker in message for marker in _DEVICE_MARKERS)
    return False


def guard_each(stage: str, items, work) -> None:
    """`work(seq, *rest)` for each `(seq, *rest)` of `items`; the sequences whose call
    raised are failed together (RequestFailed) after every other one ran."""
    failed, cause = [], None
    for item in items:
        try:
            work(*item)
        except Exception as error:  # noqa: BLE001 - attributed to this request
            if is_device_fault(error):
                raise
            logger.warning(
                "request %d: %s failed: %s", item[0].seq_id, stage, describe(error), exc_info=True
            )
            failed.append(item[0].seq_id)
            cause = cause or error
    if failed:
        raise RequestFailed(failed, stage, cause)

"""`ATOM::<stage>` annotations for torch.profiler traces, free when profiling is off.

`stage(name)` returns `torch.profiler.record_function("ATOM::" + name)` only while a
profiler is running (torch's own flag, one C call); otherwise it returns one shared
no-op context, so annotated hot paths build nothing per step.

`TraceRecorder` runs torch.profiler over a stretch of work and writes a Chrome trace
(`<dir>/atom_trace_<pid>_<n>.json`); the directory comes from `--profile`/Config or
`ATOM_TORCH_PROFILER_DIR`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path

import torch

_NO_OP = contextlib.nullcontext()
_profiler_enabled = torch.autograd._profiler_enabled
_trace_numbers = itertools.count()


def stage(name: str):
    """A context naming a stage of the step in profiler traces (`ATOM::<name>`)."""
    if _profiler_enabled():
        return torch.profiler.record_function("ATOM::" + name)
    return _NO_OP


class TraceRecorder:
    """Start/stop torch.profiler and write the trace of what ran in between."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._profile: torch.profiler.profile | None = None
        self.last_trace: Path | None = None

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        if self._profile is not None:
            raise RuntimeError("profiling is already running; call stop_profile() first")
        self.directory.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.__enter__()

    def stop(self) -> Path:
        if self._profile is None:
            raise RuntimeError("profiling is not running; call start_profile() first")
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        path = self.directory / f"atom_trace_{os.getpid()}_{next(_trace_numbers)}.json"
        profile.export_chrome_trace(str(path))
        self.last_trace = path
        return path

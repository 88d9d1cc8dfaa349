"""Keeping the start-up heap out of Python's garbage collections while the engine steps.

A full collection walks every tracked object of the process: the model's modules, torch
and transformers, the KV-cache bookkeeping - hundreds of thousands of objects that live
as long as the engine. The objects a decode step leaves alive (its requests' outputs,
their logprobs) trigger such collections every so often: a pause of 0.1-0.3 s in the
middle of a step, tens of milliseconds per step on average. `frozen_heap` moves what is
alive on entry to the permanent generation (`gc.freeze`), which collections skip, and back
on exit (`gc.unfreeze`); objects made inside are collected as usual. vLLM freezes its heap
after start-up in the same way (`freeze_gc_heap`).

On exit the frozen objects become collectable again, so garbage that existed on entry is
only deferred, never leaked; `collect_first` reclaims it before freezing (a long-lived
server loop: one full collection at start-up). Someone else's freeze (freeze count > 0)
is left alone: no nesting, no unfreezing of objects this module did not freeze.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def frozen_heap(collect_first: bool = False):
    """Collections inside the block skip every object alive on entry."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    if collect_first:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

"""Capturing CUDA graphs safely next to Python garbage collection.

A garbage collection that runs while a stream is being captured may destroy CUDA
objects of earlier work (graphs, events, pinned blocks), and some of those calls are
illegal during capture: the process aborts. `capture_graph` keeps the collector off until
the capture has ended. It captures on a side stream like `torch.cuda.graph`, without the
full collection and cache flush that torch runs before every capture (a runner slot
captures several small graphs; those would cost a tenth of a second each).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch


def capture_graph(run: Callable[[], object], pool=None):
    """Capture `run()` into a new CUDA graph; returns (graph, what run returned)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                result = run()
            finally:
                graph.capture_end()
    finally:
        if enabled:
            gc.enable()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, result

"""Capturing CUDA graphs safely next to Python garbage collection.

A garbage collection that runs while a stream is being captured may destroy CUDA
objects of earlier work (graphs, events, pinned blocks), and some of those calls are
illegal during capture: the process aborts. torch collects once before a capture; we
also keep the collector off until the capture has ended.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch


def capture_graph(run: Callable[[], object], pool=None):
    """Capture `run()` into a new CUDA graph; returns (graph, what run returned)."""
    graph = torch.cuda.CUDAGraph()
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            result = run()
    finally:
        if enabled:
            gc.enable()
    return graph, result

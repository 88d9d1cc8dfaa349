"""What every benchmark shares: JSON-lines output, device timing and the streaming-read limit.

Benchmarks print one JSON object per line on stdout (a human table, when any, goes to
stderr), so a run can be piped into a file and compared against docs/benchmarks.md.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable

import torch


def emit(record: dict | None = None, /, **fields) -> None:
    """Print one JSON line: ``record`` and/or keyword ``fields``."""
    print(json.dumps({**(record or {}), **fields}), flush=True)


def event_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    """Median device ms of one eager ``fn()`` between CUDA events (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def graph_us(body: Callable[[], object], repeats: int) -> float:
    """Median device us of one replay of a CUDA graph of ``body()``."""
    body()  # compile and allocate outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(samples)


def device_us(fn: Callable[[], object], launches: int = 20, repeats: int = 15, flush=None):
    """Median device time of one ``fn()``, from a CUDA graph of ``launches`` calls.

    With ``flush`` (a callable that evicts L2) each call is preceded by it, and the flush's
    own time (measured the same way) is subtracted.
    """

    def body():
        for _ in range(launches):
            if flush is not None:
                flush()
            fn()

    per_call = graph_us(body, repeats) / launches
    if flush is None:
        return per_call
    return per_call - graph_us(lambda: [flush() for _ in range(launches)], repeats) / launches


def expected_experts(tokens: int, top_k: int, experts: int) -> float:
    """Distinct experts `tokens` rows touch on average when each picks `top_k` of `experts`
    uniformly (top_k at one row, nearly all of them at 64 rows of top-6 of 16)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def decode_weight_bytes(model, tokens: int, top_k: int, experts: int) -> float:
    """Weight bytes a decode step of `tokens` rows reads: every parameter once, but one row
    per token of an untied embedding table, and of each grouped expert tensor (leading
    dimension `experts`) only the expected distinct experts' share."""
    names = [name for name, _ in model.named_parameters()]
    tied = not any("lm_head" in name for name in names)
    total = 0.0
    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        if "embed_tokens" in name and not tied:
            nbytes = tokens * param[0].numel() * param.element_size()
        elif ".experts." in f".{name}" and param.dim() == 3 and param.shape[0] == experts:
            nbytes *= expected_experts(tokens, top_k, experts) / experts
        total += nbytes
    return total


def read_limit(weight_bytes: float, state_bytes: float, stream_read: float | None) -> dict:
    """A decode step's read: `weight_bytes` + `state_bytes` (KV rows and recurrent state the
    step reads), and the step time and fraction of it a streaming read gives."""
    total = weight_bytes + state_bytes
    out = dict(read_mb=round(total / 1e6, 1), weight_mb=round(weight_bytes / 1e6, 1),
               state_mb=round(state_bytes / 1e6, 1))  # fmt: skip
    if stream_read:
        out["limit_ms"] = round(total / stream_read * 1e3, 3)
    return out


def streaming_bandwidth(gib: int = 4) -> dict[str, float]:
    """Bytes per second of a streaming read (a sum) and of a copy (read + write): the
    roofline a decode step's weight read is compared against."""
    src = torch.ones(gib << 28, dtype=torch.float32, device="cuda")  # gib GiB
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def best_seconds(fn, repeats=8):
        fn()
        times = []
        for _ in range(repeats):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return min(times)

    nbytes = src.numel() * src.element_size()
    read = nbytes / best_seconds(src.sum)
    copy = 2 * nbytes / best_seconds(lambda: dst.copy_(src))
    return dict(stream_read=read, stream_copy=copy)  # the buffers go with this frame

"""Per-step metadata publication, direct vs packed, in one run.

    python -m benchmarks.h2d_publication [--breakdown] [--backend mha|mla|v4|v41]

--backend picks the slot's attention backend (MHABackend, MLABackend, V4Backend or V41Backend); all
build their metadata and derive the slot mapping through the same entry point
(build_metadata / derive_views over the shared page table), so the figures are the same
machinery (V4 publishes one more small buffer: each row's state slot).

For B in {1, 64, 256} decode sequences (context ~1000 tokens, block size 16) a RunnerSlot
prepares the engine's real decode metadata (input ids, positions, context lengths, the
page table's appended block ids (every 16th row crosses a block boundary each step),
sampling parameters of non-uniform requests) and publishes it; the slot mapping is
derived on the device from the page table.
One JSON line per (backend, B): H2D copies, scatter kernels and bytes per step, host issue
time per step (`host_issue_us`: the publisher's work, i.e. the step's publish calls and
its flush, replayed on the same staged buffers; `slot_publish_us`: the whole consumer path
of the RunnerSlot around them, metadata objects and profiler hooks included; medians),
GPU time per step (CUDA
events, publication and the views), `views_us`: launching the consumer-side kernels that
apply the page-table deltas and derive the slot mapping (not publication), host time of
`prepare` (the producers, identical work in both modes), and the cost of the
production-mode checks (producer guard + per-publication bounds + the stream check).
`packed_eager_scatter` issues the copy and launches the scatter kernel from Python instead
of replaying them from the flush's CUDA graph. As in the engine, the slot waits for its
previous transfers before the producers run, so the guard's check is a flag test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

import torch

from atom.attention.family import AttentionFamily, MLAFamily
from atom.attention.gdn import GDNFamily
from atom.attention.v4 import V4Family
from atom.attention.v41 import V41Family
from atom.model_engine.runner_slot import RunnerSlot
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.sequence import Sequence
from atom.sampling_params import SamplingParams

# A runner slot's backend by its family's name (the --backend choices).
BACKENDS = {
    family.name: family.backend_class
    for family in (AttentionFamily, MLAFamily, V4Family, V41Family, GDNFamily)
}


def decode_batch(batch_size: int, context: int, block_size: int) -> ScheduledBatch:
    seqs = []
    for i in range(batch_size):
        seq = Sequence(
            list(range(context)),
            SamplingParams(temperature=0.5 + i % 3 * 0.1, top_p=0.9, max_tokens=8),
        )
        seq.num_computed_tokens = context - 1
        seq.block_table = list(range(i * 70, i * 70 + -(-context // block_size)))
        seq.state_slot = i  # read by the v4 backend only
        seqs.append(seq)
    return ScheduledBatch(seqs, [1] * batch_size, batch_size, layout=1, grown=[], step=0)


def advance(batch: ScheduledBatch, iteration: int, next_block: list[int]) -> ScheduledBatch:
    """The next decode step of the same batch: every 16th sequence crosses a block boundary
    (block size 16), so the page table stages one appended id for each of those rows."""
    grown = batch.seqs[iteration % 16 :: 16]
    for seq in grown:
        if len(seq.block_table) >= 120:  # stay inside the 128-block rows
            del seq.block_table[63:]
            seq.block_version += 1
        seq.block_table.append(next_block[0])
        next_block[0] += 1
    return replace(batch, step=batch.step + 1, grown=grown)


def measure(
    backend: str,
    batch_size: int,
    iterations: int,
    scatter_graph: bool = True,
    attention: str = "mha",
) -> dict:
    device = torch.device("cuda")
    slot = RunnerSlot(
        0,
        256,
        8192,
        128,
        16,
        128256,
        device,
        h2d_backend=backend,
        h2d_checked=False,
        backend=BACKENDS[attention](),
    )
    if backend == "packed" and not scatter_graph:
        slot.publisher._graphs = []  # issue the copy and launch the Triton kernel every step
    batch = decode_batch(batch_size, 1000, 16)
    publisher = slot.publisher
    buffers = slot._staged
    samples = {key: [] for key in ("host", "slot", "gpu", "checks", "prepare", "views")}
    copies = kernels = nbytes = 0
    start_event, end_event = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    next_block = [batch_size * 70]
    for i in range(iterations + 10):
        batch = advance(batch, i, next_block)
        slot.wait_for_transfers()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        step = slot.prepare(batch)
        t2 = time.perf_counter()
        before = (publisher.copies, publisher.kernels, publisher.bytes)
        header_before = getattr(publisher, "_header_descriptors", None)
        start_event.record()
        t3 = time.perf_counter()
        slot._queue(step)
        group = list(publisher._group)
        publisher.flush()
        t4 = time.perf_counter()
        # consumer side, not publication: page-table deltas applied, slot mapping derived
        slot.page_table.on_published()
        slot.backend.derive_views(slot, step.num_tokens, step.num_seqs, step.is_decode)
        t4b = time.perf_counter()
        end_event.record()
        # The production checks of this step, timed alone: the producer guard's check,
        # each publication's bounds check and the once-per-flush stream check.
        publisher._last_flush = None  # as after wait_for_transfers()
        t5 = time.perf_counter()
        publisher.check_producer(buffers)
        for b in group:
            publisher.in_bounds(b, b.staged_rows, b.staged_rows)
        publisher.check_stream()
        t6 = time.perf_counter()
        end_event.synchronize()
        counted = (publisher.copies, publisher.kernels, publisher.bytes)
        # The publisher alone: the same publications again (same buffers, sizes, staged
        # memory and header state), without the slot's consumer-side bookkeeping.
        if header_before is not None or backend == "packed":
            publisher._header_descriptors = header_before
        t7 = time.perf_counter()
        for b in group:
            publisher.publish(b, b.staged_rows, b.staged_rows)
        publisher.flush()
        t8 = time.perf_counter()
        publisher.wait_for_transfers()
        if i >= 10:
            samples["checks"].append(t6 - t5)
            samples["prepare"].append(t2 - t1)
            samples["slot"].append(t4 - t3)
            samples["host"].append(t8 - t7)
            samples["views"].append(t4b - t4)
            samples["gpu"].append(start_event.elapsed_time(end_event) / 1e3)
            copies += counted[0] - before[0]
            kernels += counted[1] - before[1]
            nbytes += counted[2] - before[2]
    n = iterations
    name = backend if scatter_graph or backend == "direct" else "packed_eager_scatter"

    def median_us(key: str, digits: int = 2) -> float:
        return round(statistics.median(samples[key]) * 1e6, digits)

    return dict(
        backend=name,
        attention_backend=slot.backend.name,
        batch=batch_size,
        copies_per_step=copies / n,
        kernels_per_step=kernels / n,
        bytes_per_step=nbytes / n,
        host_issue_us=median_us("host"),
        slot_publish_us=median_us("slot"),
        gpu_us=median_us("gpu"),
        prepare_us=median_us("prepare"),
        views_us=median_us("views"),
        production_checks_us=median_us("checks", 3),
    )


def _median_us(fn, iterations: int = 300) -> float:
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return round(statistics.median(samples) * 1e6, 2)


def breakdown(batch_size: int = 256) -> None:
    """Where the host time goes on this machine: primitive costs, then a cProfile of the
    publication path of each backend (one JSON line each)."""
    import cProfile
    import io
    import pstats

    host = torch.zeros(64, dtype=torch.uint8, pin_memory=True)
    device = torch.zeros(64, dtype=torch.uint8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        device.add_(1)
    event = torch.cuda.Event()
    array = host.numpy()
    primitives = dict(
        copy_pinned_64B_us=_median_us(lambda: device.copy_(host, non_blocking=True)),
        graph_replay_us=_median_us(graph.replay),
        event_record_us=_median_us(event.record),
        event_query_us=_median_us(event.query),
        tensor_slice_us=_median_us(lambda: device[:32]),
        numpy_slice_assign_us=_median_us(lambda: array.__setitem__(slice(0, 8), 3)),
    )
    print(json.dumps(dict(case="primitives", **primitives)), flush=True)
    for backend in ("direct", "packed"):
        slot = RunnerSlot(
            0, 256, 8192, 128, 16, 128256, torch.device("cuda"), backend, h2d_checked=False
        )
        batch = decode_batch(batch_size, 1000, 16)
        next_block = [batch_size * 70]
        profile = cProfile.Profile()
        for i in range(200):
            batch = advance(batch, i, next_block)
            slot.wait_for_transfers()
            step = slot.prepare(batch)
            profile.enable()
            slot._queue(step)
            slot.publisher.flush()
            profile.disable()
            slot.page_table.on_published()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(12)
        lines = [line for line in out.getvalue().splitlines() if line.strip()][-13:]
        print(json.dumps(dict(case="profile", backend=backend, top=lines)), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="mha")
    parser.add_argument("--breakdown", action="store_true", help="per-phase cost of one step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    if args.breakdown:
        breakdown()
        return 0
    attention = args.backend
    results = {}
    for batch_size in (1, 64, 256):
        for backend, graph in (("direct", True), ("packed", True), ("packed", False)):
            record = measure(
                backend, batch_size, iterations=300, scatter_graph=graph, attention=attention
            )
            results[(record["backend"], batch_size)] = record
            print(json.dumps(record), flush=True)
    for batch_size in (1, 64, 256):
        d, p = results[("direct", batch_size)], results[("packed", batch_size)]
        ratios = dict(
            batch=batch_size,
            packed_over_direct_host_issue=round(p["host_issue_us"] / d["host_issue_us"], 3),
            packed_over_direct_slot_publish=round(p["slot_publish_us"] / d["slot_publish_us"], 3),
        )
        print(json.dumps(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())

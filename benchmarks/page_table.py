"""Per-step cost of keeping the device block table current, three ways, in one run.

    python -m benchmarks.page_table [--device cuda|cpu] [--backend mha|mla|v4|v41]

--backend picks the attention backend of the runner slot (MHABackend, MLABackend,
V4Backend or V41Backend): all take their rows from the same versioned page table, so the atom_* figures
are the same machinery for each (each line names the backend).

For B in {1, 64, 256} rows and {128, 2048} blocks per row, one JSON line per case:
  atom_unchanged      the versioned page table, same batch as the previous step
  atom_one_append     one row gains a block
  atom_all_append     every row gains a block (decode crossing a block boundary)
  atom_reorder        the batch order is reversed (every row moves)
  rebuild             nano-vllm style: rows rebuilt from Python lists, whole table uploaded
  full_width_copy     vLLM V1 style: numpy rows kept on the host, first B rows copied at
                      full width every step
Each line: host_us per step (the host work that makes the device table current: sync,
staging, publication, the flush and the delta kernels' launches; the device is
synchronized and the slot's producer guard, which covers every buffer of the step and is
measured by the h2d benchmark, runs before the clock starts), h2d_bytes per step, and the
ratios against the two baselines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from atom.attention.family import AttentionFamily, MLAFamily
from atom.attention.gdn import GDNFamily
from atom.attention.v4 import V4Family
from atom.attention.v41 import V41Family
from atom.model_engine.runner_slot import RunnerSlot
from atom.model_engine.sequence import Sequence
from atom.sampling_params import SamplingParams

# A runner slot's backend by its family's name (the --backend choices).
BACKENDS = {
    family.name: family.backend_class
    for family in (AttentionFamily, MLAFamily, V4Family, V41Family, GDNFamily)
}

BLOCK_SIZE = 16


def _sequences(batch: int, width: int) -> list[Sequence]:
    fill = width // 2
    seqs = []
    for i in range(batch):
        seq = Sequence([1] * (fill * BLOCK_SIZE), SamplingParams(max_tokens=8))
        seq.block_table = list(range(i * width, i * width + fill))
        seqs.append(seq)
    return seqs


def _time(fn, iterations: int, device: torch.device, setup=None) -> float:
    """Median host microseconds of fn(i) (device synchronized between calls)."""
    samples = []
    for i in range(iterations + 5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn(i)
        elapsed = time.perf_counter() - start
        if i >= 5:
            samples.append(elapsed * 1e6)
    return statistics.median(samples)


def measure_atom(case: str, batch: int, width: int, device, iterations: int, backend="mha"):
    slot = RunnerSlot(
        0,
        batch,
        8192,
        width,
        BLOCK_SIZE,
        32000,
        device,
        h2d_backend="direct",
        h2d_checked=False,
        backend=BACKENDS[backend](),
    )
    table, publisher = slot.page_table, slot.publisher
    seqs = _sequences(batch, width)
    orders = [seqs, seqs[::-1]]
    state = {"step": 0, "layout": 0, "next_block": batch * width}

    def guard():
        publisher.producer_guard(slot._staged)

    def sync(order, grown, new_layout):
        state["step"] += 1
        state["layout"] += new_layout
        table.sync(order, state["layout"], grown, state["step"])
        table.publish(batch)
        publisher.flush()
        table.on_published()

    guard()
    sync(seqs, [], True)  # the first step writes every row
    nbytes = []

    def step(i):
        if case == "unchanged":
            order, grown, new_layout = seqs, [], False
        elif case == "reorder":
            order, grown, new_layout = orders[(i + 1) % 2], [], True
        else:
            grown = [seqs[i % batch]] if case == "one_append" else seqs
            for seq in grown:
                if len(seq.block_table) >= width:
                    del seq.block_table[width // 2 :]  # keep room (rows never shrink in use)
                    seq.block_version += 1
                seq.block_table.append(state["next_block"])
                state["next_block"] += 1
            order, new_layout = seqs, False
        sync(order, grown, new_layout)
        nbytes.append(table.last_bytes)

    if case == "reorder":
        for order in (orders[1], orders[0]):
            guard()
            sync(order, [], True)
    host_us = _time(step, iterations, device, setup=guard)
    if device.type == "cuda":
        torch.cuda.synchronize()
    table.check_device()
    return host_us, float(np.mean(nbytes))


def measure_rebuild(batch: int, width: int, device, iterations: int):
    """nano-vllm: pad every row from Python lists into a new tensor, upload it whole."""
    seqs = _sequences(batch, width)
    pin = device.type == "cuda"
    dest = torch.empty((batch, width), dtype=torch.int32, device=device)

    def step(_):
        rows = [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs]
        host = torch.tensor(rows, dtype=torch.int32, pin_memory=pin)
        dest.copy_(host, non_blocking=True)

    return _time(step, iterations, device), batch * width * 4


def measure_full_width_copy(batch: int, width: int, device, iterations: int):
    """vLLM V1: a persistent numpy table; the first B rows go up at full width each step."""
    pin = device.type == "cuda"
    host = torch.zeros((batch, width), dtype=torch.int32, pin_memory=pin)
    for row, seq in enumerate(_sequences(batch, width)):
        host.numpy()[row, : len(seq.block_table)] = seq.block_table
    dest = torch.empty((batch, width), dtype=torch.int32, device=device)

    def step(_):
        dest[:batch].copy_(host[:batch], non_blocking=True)

    return _time(step, iterations, device), batch * width * 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="mha")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    for width in (128, 2048):
        for batch in (1, 64, 256):
            rebuild_us, rebuild_bytes = measure_rebuild(batch, width, device, args.iterations)
            copy_us, copy_bytes = measure_full_width_copy(batch, width, device, args.iterations)
            base = dict(device=args.device, batch=batch, blocks=width)
            print(json.dumps(dict(base, case="rebuild", host_us=round(rebuild_us, 2),
                                  h2d_bytes=rebuild_bytes)))  # fmt: skip
            print(json.dumps(dict(base, case="full_width_copy", host_us=round(copy_us, 2),
                                  h2d_bytes=copy_bytes)))  # fmt: skip
            for case in ("unchanged", "one_append", "all_append", "reorder"):
                host_us, nbytes = measure_atom(
                    case, batch, width, device, args.iterations, args.backend
                )
                record = dict(
                    base,
                    case=f"atom_{case}",
                    backend=args.backend,
                    host_us=round(host_us, 2),
                    h2d_bytes=nbytes,
                    rebuild_over_atom=round(rebuild_us / host_us, 1),
                    full_width_copy_over_atom=round(copy_us / host_us, 1),
                )
                print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

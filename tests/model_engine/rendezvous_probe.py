"""Cheap stand-ins for engines and ranks (no model): the rendezvous tests spawn these.

`python -m tests.model_engine.rendezvous_probe [--go-file F]` is one "engine" (or one
node of one, with --nnodes/--node-rank/--port): once F exists it binds the rendezvous
store (port 0 by default), starts its ranks, which join the process group, all-reduce
and gather the rank layout, and prints one JSON line with what they saw. Its ranks
are forked (this process has run no torch op), not spawned: eight such engines would
otherwise import torch 24 times on a 2-core test machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from atom.model_engine.rendezvous import Rendezvous, destroy_process_group, init_process_group
from atom.model_engine.workers import SHUTDOWN, WorkerGroup


def layout_probe(local_rank, spec, conn):
    """Join, all-reduce rank + 1, gather everyone's (rank, node, local rank, pid)."""
    tp = init_process_group(spec, local_rank, "cpu")
    try:
        total = tp.all_reduce(torch.tensor([float(tp.rank + 1)]))
        layout = [None] * spec.world_size
        dist.all_gather_object(layout, (tp.rank, spec.node_rank, local_rank, os.getpid()))
        conn.send(("ready", {"rank": tp.rank, "sum": total.item(), "layout": layout}))
        while conn.recv_bytes() != SHUTDOWN:
            pass
    finally:
        destroy_process_group()


def failing_probe(local_rank, spec, conn, failing_rank):
    """Rank `failing_rank` raises after joining; the others wait in a collective."""
    tp = init_process_group(spec, local_rank, "cpu")
    try:
        if tp.rank == failing_rank:
            raise ValueError(f"probe failure on rank {tp.rank}")
        tp.all_reduce(torch.ones(1))
        conn.send(("ready", {}))
        while conn.recv_bytes() != SHUTDOWN:
            pass
    finally:
        destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--go-file", help="print 'imported', then wait for this file")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    args = parser.parse_args(argv)
    if args.go_file:
        print("imported", flush=True)
        while not os.path.exists(args.go_file):
            time.sleep(0.002)
    began = time.time()
    rendezvous = Rendezvous.start(
        world_size=args.world_size,
        master_port=args.port,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        timeout_s=60,
    )
    port = rendezvous.spec.port
    group = WorkerGroup(layout_probe, rendezvous, start_method="fork")
    try:
        infos = group.wait_ready()
    finally:
        group.shutdown()
    result = {"port": port, "began": began, "infos": infos, "pids": group.pids}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

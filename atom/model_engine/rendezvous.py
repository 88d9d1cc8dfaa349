"""Rendezvous: the TCPStore where the tensor- and pipeline-parallel ranks meet.

The engine's process binds the store as master *before* it spawns any worker, so no
free-port race exists: on a single node it binds port 0 and reads the real port back
(`store.port`); choosing a port by binding 0, closing it and binding it again in a
worker loses races (EADDRINUSE) when several engines start together. Multi-node runs
use an explicit port that every node is told (`--master-addr/--master-port`): node 0
binds it, the other nodes connect as clients. Every rank, local or remote, connects as
a client and calls `init_process_group(backend, store=..., rank, world_size)`.

The store lives as long as the engine (`Rendezvous.close` releases the port). Ranks are
laid out node by node: global rank = node_rank * ranks_per_node + local_rank, and stage
by stage: global rank = stage * tensor_parallel_size + tensor-parallel rank.

Data parallelism: one store for all replicas, bound before any of them spawns; each
replica's ranks form their own process group under their own key prefix
(`replica_spec`), so the groups never see each other's keys.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from atom.distributed import PipelineGroup, TensorParallelGroup

# Keys of the process group live under this prefix; the engine's own keys (remote step
# queues, failure reports) under others, so they never collide.
PROCESS_GROUP_PREFIX = "process_group/"


class RendezvousError(RuntimeError):
    """The ranks could not meet; the message names the address and what to do."""


class PortInUseError(RendezvousError):
    """The fixed rendezvous port is taken by another process."""


@dataclass(frozen=True)
class RendezvousSpec:
    """Where the ranks meet and who they are; picklable, handed to every spawned rank."""

    host: str
    port: int
    world_size: int
    nnodes: int = 1
    node_rank: int = 0
    backend: str = "gloo"  # nccl on CUDA
    timeout_s: float = 1800.0
    pipeline_parallel_size: int = 1  # stages; world_size / it ranks per stage
    replica: int | None = None  # data-parallel replica index (None: no data parallelism)
    prefix: str = ""  # store keys of this replica's process group live under it
    first_device: int = 0  # CUDA index of local rank 0 (replicas share a node's GPUs)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def tensor_parallel_size(self) -> int:
        return self.world_size // self.pipeline_parallel_size

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.ranks_per_node + local_rank

    def describe(self, rank: int) -> str:
        """How errors name a rank: replica, pipeline stage, tensor-parallel rank."""
        stage, tp_rank = divmod(rank, self.tensor_parallel_size)
        if self.pipeline_parallel_size == 1:
            text = f"tensor-parallel rank {rank}"
        elif self.tensor_parallel_size == 1:
            text = f"pipeline stage {stage} (rank {rank})"
        else:
            text = f"pipeline stage {stage}, tensor-parallel rank {tp_rank} (rank {rank})"
        return text if self.replica is None else f"replica {self.replica}, {text}"

    def replica_spec(self, replica: int, ranks_per_replica: int, pipeline_parallel_size: int):
        """The spec of data-parallel replica `replica` on this (shared) store."""
        return replace(
            self,
            world_size=ranks_per_replica,
            pipeline_parallel_size=pipeline_parallel_size,
            replica=replica,
            prefix=f"replica{replica}/",
            first_device=replica * ranks_per_replica,
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class Rendezvous:
    """This node's end of the rendezvous: the master store on node 0, a client elsewhere.

    Create it before spawning workers; hand `spec` to them; `close()` on shutdown.
    """

    def __init__(self, store: dist.TCPStore, spec: RendezvousSpec):
        self.store: dist.TCPStore | None = store
        self.spec = spec

    @classmethod
    def start(
        cls,
        world_size: int,
        backend: str = "gloo",
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        nnodes: int = 1,
        node_rank: int = 0,
        timeout_s: float = 1800.0,
        pipeline_parallel_size: int = 1,
    ) -> Rendezvous:
        if world_size % nnodes:
            raise RendezvousError(f"{world_size} ranks do not split over {nnodes} nodes")
        if nnodes > 1 and master_port == 0:
            raise RendezvousError(
                "a multi-node run needs a fixed --master-port that every node is given "
                "(port 0 picks a free port, which only works on one node)"
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        if node_rank == 0:
            store = _bind_master(master_addr, master_port, timeout)
        else:
            store = _connect(master_addr, master_port, timeout)
        spec = RendezvousSpec(
            host=master_addr,
            port=store.port,
            world_size=world_size,
            nnodes=nnodes,
            node_rank=node_rank,
            backend=backend,
            timeout_s=timeout_s,
            pipeline_parallel_size=pipeline_parallel_size,
        )
        return cls(store, spec)

    @property
    def is_master(self) -> bool:
        return self.spec.node_rank == 0

    def close(self) -> None:
        """Drop this process's store: on node 0 the server stops and the port is free."""
        self.store = None

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bind_master(host: str, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
    except (dist.DistNetworkError, RuntimeError) as error:
        text = str(error)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise PortInUseError(
                f"cannot host the rendezvous store on port {port}: the port is already in use "
                f"(another atom engine or program holds it). Choose a free port with "
                f"--master-port, or leave --master-port at 0 on a single node so the engine "
                f"picks a free one itself"
            ) from None
        raise RendezvousError(
            f"cannot host the rendezvous store on {host}:{port}: {text}"
        ) from error


def _connect(host: str, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A client of the store; retries until `timeout` (node 0 may start later)."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    except (dist.DistNetworkError, dist.DistStoreError, RuntimeError) as error:
        raise RendezvousError(
            f"cannot reach the rendezvous store at {host}:{port} within "
            f"{timeout.total_seconds():.0f} s ({type(error).__name__}: {error}); is node-rank 0 "
            f"running with the same --master-addr/--master-port, and is the port reachable?"
        ) from error


def connect(spec: RendezvousSpec) -> dist.TCPStore:
    """A rank's own client of the store."""
    return _connect(spec.host, spec.port, datetime.timedelta(seconds=spec.timeout_s))


def init_process_group(
    spec: RendezvousSpec, local_rank: int, device: torch.device | str
) -> TensorParallelGroup:
    """Join the process group as `spec.global_rank(local_rank)`; returns this rank's group.

    Called in each spawned rank. Clean up with `destroy_process_group()`.
    """
    rank = spec.global_rank(local_rank)
    store = dist.PrefixStore(spec.prefix + PROCESS_GROUP_PREFIX, connect(spec))
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
    )
    return TensorParallelGroup(rank, spec.world_size, dist.group.WORLD, device)


def init_parallel_groups(
    spec: RendezvousSpec, local_rank: int, device: torch.device | str
) -> tuple[TensorParallelGroup, PipelineGroup | None]:
    """Join the process group; returns this rank's tensor-parallel group (its stage's
    ranks) and, with more than one stage, its PipelineGroup."""
    world = init_process_group(spec, local_rank, device)
    stages = spec.pipeline_parallel_size
    if stages == 1:
        return world, None
    size = spec.tensor_parallel_size
    stage, tp_rank = divmod(world.rank, size)
    group = None
    if size > 1:  # every rank creates every stage's group, in order (torch.distributed's rule)
        groups = [dist.new_group(list(range(s * size, (s + 1) * size))) for s in range(stages)]
        group = groups[stage]
    tp = TensorParallelGroup(tp_rank, size, group, device)
    return tp, PipelineGroup(stage, stages, tp_rank, size, device, dist.group.WORLD)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

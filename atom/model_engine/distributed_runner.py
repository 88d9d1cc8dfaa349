"""DistributedRunner: the engine's ModelRunner when `tensor_parallel_size` > 1.

The engine process keeps the scheduler and runs no model. Before it spawns anything it
binds the rendezvous store (rendezvous.py); then every tensor-parallel rank is a spawned
worker (workers.py) running `run_model_rank`: join the process group, load its shard of
the weights, allocate its KV cache (num_kv_heads / N heads), then loop — receive the
step's message (step_messages.py), update its mirror of the sequences, run the same
ModelRunner step as every other rank. Rank 0 samples and sends the tokens back.

On CUDA rank r of a node uses `cuda:{local_rank}`; decode CUDA graphs are not captured
under tensor parallelism yet (the ranks run eagerly).
"""

from __future__ import annotations

import copy
import logging
import os
import pickle

import torch

from atom.config import Config
from atom.model_engine.model_runner import ModelRunner
from atom.model_engine.rendezvous import (
    Rendezvous,
    RendezvousSpec,
    backend_for,
    destroy_process_group,
    init_process_group,
)
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.step_messages import SequenceMirror, StepEncoder
from atom.model_engine.workers import SHUTDOWN, WorkerGroup, serve_remote_node
from atom.models.registry import model_class

logger = logging.getLogger(__name__)


def start_rendezvous(config: Config) -> Rendezvous:
    return Rendezvous.start(
        world_size=config.tensor_parallel_size,
        backend=backend_for(config.device),
        master_addr=config.master_addr,
        master_port=config.master_port,
        nnodes=config.nnodes,
        node_rank=config.node_rank,
        timeout_s=config.distributed_timeout_s,
    )


class DistributedRunner:
    """Same interface as ModelRunner for the engine: `launch(batch)` returns a handle
    whose `result()` is the sampled tokens; `num_kvcache_blocks`; `h2d_totals()`;
    `shutdown()`."""

    def __init__(self, config: Config, model_path: str, hf_config, max_model_len: int):
        # Fail before spawning anything if the model does not split over the ranks.
        model_class(hf_config).validate_tensor_parallel(hf_config, config.tensor_parallel_size)
        rendezvous = start_rendezvous(config)
        self.port = rendezvous.spec.port
        self.workers = WorkerGroup(
            run_model_rank, rendezvous, args=(config, model_path, max_model_len)
        )
        try:
            infos = self.workers.wait_ready()
        except BaseException:
            self.workers.shutdown(timeout_s=1.0)
            raise
        self.num_kvcache_blocks = infos[0]["num_kvcache_blocks"]
        self.encoder = StepEncoder()
        self._h2d_totals = (0, 0)  # rank 0's, as of the latest step read
        logger.info(
            "tensor parallelism: %d ranks (pids %s), rendezvous at %s",
            config.tensor_parallel_size,
            self.workers.pids,
            rendezvous.spec.address,
        )

    def launch(self, batch: ScheduledBatch) -> RemoteStepHandle:
        message = self.encoder.encode(batch)
        self.workers.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        return RemoteStepHandle(self, batch)

    def h2d_totals(self) -> tuple[int, int]:
        """Rank 0's cumulative host-to-device copies and bytes (every rank publishes the
        same step metadata), as reported with the latest step's tokens."""
        return self._h2d_totals

    def shutdown(self) -> None:
        self.workers.shutdown()


class RemoteStepHandle:
    """Tokens of a step launched on the ranks; read in launch order (rank 0 answers each
    step once, in order)."""

    def __init__(self, runner: DistributedRunner, batch: ScheduledBatch):
        self._runner = runner
        self._batch = batch
        self._tokens: list[int] | None = None

    def result(self) -> list[int]:
        if self._tokens is None:
            message = self._runner.workers.receive(0)
            if message[0] != "result":
                raise RuntimeError(f"rank 0 answered a step with {message[0]!r}")
            _, tokens, h2d_totals = message
            self._tokens = tokens
            self._runner._h2d_totals = h2d_totals
            self._runner.encoder.record_sampled(self._batch, tokens)
        return self._tokens


def _rank_device(config: Config, local_rank: int) -> str:
    if config.device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return "cpu"


def run_model_rank(local_rank, spec: RendezvousSpec, conn, config, model_path, max_model_len):
    """One tensor-parallel rank (a spawned process); see the module docstring."""
    from atom.models.loader import open_model, read_config

    device = _rank_device(config, local_rank)
    if device == "cpu":  # share the cores instead of each rank taking them all
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.ranks_per_node))
    tp = init_process_group(spec, local_rank, device)
    # No try/finally around the process group: on an exception the error must reach the
    # engine first (a teardown after a peer died may block); the process exits right after.
    if config.load_format == "dummy":
        hf_config, weights = read_config(model_path), None
    else:
        source = open_model(model_path)
        hf_config, weights = source.hf_config, source.weights()
    # Validated by the engine already: copy without re-validating the per-rank device.
    rank_config = copy.copy(config)
    rank_config.device = device
    rank_config.enforce_eager = True  # no CUDA graphs across ranks yet
    runner = ModelRunner(rank_config, hf_config, weights, max_model_len, tp)
    conn.send(("ready", {"num_kvcache_blocks": runner.num_kvcache_blocks}))
    mirror = SequenceMirror()
    while True:
        payload = conn.recv_bytes()
        if payload == SHUTDOWN:
            break
        batch = mirror.apply(pickle.loads(payload))
        handle = runner.launch(batch)
        mirror.on_launch(batch)
        tokens = handle.result()
        if tp.is_first:
            conn.send(("result", tokens, runner.h2d_totals()))
    destroy_process_group()


def serve_node(config: Config, max_model_len: int) -> None:
    """Node-rank > 0 of a multi-node run: host this node's ranks until node 0 stops."""
    from atom.models.default_model import default_model_path

    rendezvous = start_rendezvous(config)
    logger.info(
        "node %d of %d: serving ranks %s, rendezvous at %s",
        config.node_rank,
        config.nnodes,
        [rendezvous.spec.global_rank(i) for i in range(rendezvous.spec.ranks_per_node)],
        rendezvous.spec.address,
    )
    model_path = config.model or default_model_path()
    serve_remote_node(run_model_rank, rendezvous, args=(config, model_path, max_model_len))

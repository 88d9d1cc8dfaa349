"""DistributedRunner: the engine's ModelRunner when the model runs on spawned ranks
(`tensor_parallel_size` or `pipeline_parallel_size` > 1, or a data-parallel replica).

The engine process keeps the scheduler and runs no model. Before it spawns anything it
binds the rendezvous store (rendezvous.py); then every rank is a spawned worker
(workers.py) running `run_model_rank`: join the process group (its stage's
tensor-parallel group and, with several stages, its PipelineGroup), load its shard of its
stage's weights, allocate its KV cache (its stage's layers, num_kv_heads / N heads),
then loop — receive the step's message (step_messages.py), update its mirror of the
sequences, run its ModelRunner step. Every rank of every stage receives every message, so
each stage's runner slots and page tables follow the same batches on their own. Rank 0
(tensor-parallel rank 0 of the first stage) sends the tokens back.

On CUDA local rank r uses `cuda:{first_device + r}`; decode CUDA graphs are not captured
on spawned ranks yet (they run eagerly).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import pickle
import time

import torch

from atom.config import Config
from atom.distributed import PipelineError
from atom.model_engine.model_runner import ModelRunner
from atom.model_engine.rendezvous import (
    Rendezvous,
    RendezvousSpec,
    backend_for,
    destroy_process_group,
    init_parallel_groups,
)
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.step_messages import SequenceMirror, StepEncoder
from atom.model_engine.workers import SHUTDOWN, WorkerGroup, serve_remote_node
from atom.models.registry import model_class

logger = logging.getLogger(__name__)

STATS = b"stats"  # asks every rank for its counters (and resets them)


def validate_parallelism(config: Config, hf_config) -> None:
    """Fail before spawning anything if the model does not split over the ranks."""
    cls = model_class(hf_config)
    cls.validate_tensor_parallel(hf_config, config.tensor_parallel_size)
    stages = config.pipeline_parallel_size
    if stages > 1:
        # A family that splits over stages has a model class with the stage methods.
        if not cls.family(hf_config).supports.pipeline_parallel:
            raise PipelineError(
                f"{hf_config.model_type}: pipeline parallelism is not supported for this model "
                "yet; run with --pipeline-parallel-size 1"
            )
        cls.validate_pipeline_parallel(hf_config, stages)


def start_rendezvous(config: Config, world_size: int | None = None) -> Rendezvous:
    return Rendezvous.start(
        world_size=world_size or config.ranks_per_replica,
        backend=backend_for(config.device),
        master_addr=config.master_addr,
        master_port=config.master_port,
        nnodes=config.nnodes,
        node_rank=config.node_rank,
        timeout_s=config.distributed_timeout_s,
        pipeline_parallel_size=config.pipeline_parallel_size,
    )


class DistributedRunner:
    """The engine's StepRunner (protocols.py), as ModelRunner is in one process:
    `launch(batch)` returns a handle whose `result()` is the sampled tokens;
    `num_kvcache_blocks`; `h2d_totals()`; and `shutdown()`."""

    def __init__(
        self,
        config: Config,
        model_path: str,
        hf_config,
        max_model_len: int,
        rendezvous: Rendezvous | None = None,
        wait: bool = True,
    ):
        """`rendezvous`: a data-parallel replica's view of the shared store (default: bind
        one of its own). `wait=False` returns once spawned; call `wait_ready()`."""
        validate_parallelism(config, hf_config)
        rendezvous = rendezvous or start_rendezvous(config)
        self.port = rendezvous.spec.port
        self.spec = rendezvous.spec
        self.config = config
        self.workers = WorkerGroup(
            run_model_rank,
            rendezvous,
            args=(config, model_path, max_model_len),
            name="atom-rank" if self.spec.replica is None else f"atom-dp{self.spec.replica}",
        )
        self.num_kvcache_blocks: int | None = None
        self.encoder = StepEncoder()
        self._h2d_totals = (0, 0)  # rank 0's, as of the latest step read
        # Sampling state and speculative state snapshots live in the rank processes.
        self.sampling_state = None
        self.state_snapshots = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        try:
            infos = self.workers.wait_ready()
        except BaseException:
            self.workers.shutdown(timeout_s=1.0)
            raise
        self.num_kvcache_blocks = infos[0]["num_kvcache_blocks"]
        logger.info(
            "%s%d ranks (tensor %d x pipeline %d, pids %s), rendezvous at %s",
            "" if self.spec.replica is None else f"replica {self.spec.replica}: ",
            self.spec.world_size,
            self.spec.tensor_parallel_size,
            self.spec.pipeline_parallel_size,
            self.workers.pids,
            self.spec.address,
        )

    def rank_stats(self) -> list[dict]:
        """Every local rank's counters since the last call (steps, seconds in steps,
        seconds blocked on the previous/next stage, seconds between steps, page-table
        revisions per runner slot), in rank order; the counters restart."""
        self.workers.send(STATS)
        stats = []
        for local_rank in range(len(self.workers.conns)):
            kind, value = self.workers.receive(local_rank)[:2]
            if kind != "stats":
                raise RuntimeError(f"rank {self.workers.ranks[local_rank]} sent {kind!r}")
            stats.append(value)
        return stats

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
    """The LaunchedStep (protocols.py) of a step launched on the ranks: its tokens, read in launch order (rank 0 answers each
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

    def logprobs(self) -> None:
        """None: log-probabilities are refused with spawned ranks (LLMEngine._engine_params)."""
        return None


def _rank_device(config: Config, spec: RendezvousSpec, local_rank: int) -> str:
    if config.device.startswith("cuda"):
        index = spec.first_device + local_rank
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    return "cpu"


class _RankCounters:
    """What `rank_stats` reports: where a rank's time went since the last report."""

    def __init__(self, pp):
        self.pp = pp
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.step_seconds = 0.0  # from a step's message to its end (waits included)
        self.between_seconds = 0.0  # waiting for the next message (after the first step)
        if self.pp is not None:
            self.pp.wait_seconds = 0.0

    def report(self, runner: ModelRunner) -> dict:
        pp, tp = self.pp, runner.tp
        return {
            "stage": 0 if pp is None else pp.stage,
            "tp_rank": tp.rank,
            "steps": self.steps,
            "step_seconds": self.step_seconds,
            "wait_seconds": 0.0 if pp is None else pp.wait_seconds,
            "between_seconds": self.between_seconds,
            "page_tables": [
                (slot.page_table.cpu_revision, slot.page_table.gpu_revision)
                for slot in runner.slots
            ],
        }


def run_model_rank(local_rank, spec: RendezvousSpec, conn, config, model_path, max_model_len):
    """One rank (a spawned process); see the module docstring."""
    from atom.models.loader import open_model, read_config

    device = _rank_device(config, spec, local_rank)
    if device == "cpu":  # share the cores instead of each rank taking them all
        ranks = spec.ranks_per_node * config.data_parallel_size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    tp, pp = init_parallel_groups(spec, local_rank, device)
    # No try/finally around the process group: on an exception the error must reach the
    # engine first (a teardown after a peer died may block); the process exits right after.
    if config.load_format == "dummy":
        hf_config, weights = read_config(model_path), None
    else:
        source = open_model(model_path)
        hf_config = source.hf_config
        # pp is set only for a family that supports pipeline parallelism (validated).
        cls = model_class(hf_config)
        wanted = None if pp is None else functools.partial(cls.stage_holds, hf_config, pp)
        weights = source.weights(wanted)  # a pipeline stage reads only its own tensors
    # Validated by the engine already: copy without re-validating the per-rank device.
    rank_config = copy.copy(config)
    rank_config.device = device
    rank_config.enforce_eager = True  # no CUDA graphs across ranks yet
    runner = ModelRunner(rank_config, hf_config, weights, max_model_len, tp, pp=pp)
    conn.send(("ready", {"num_kvcache_blocks": runner.num_kvcache_blocks}))
    mirror = SequenceMirror()
    counters = _RankCounters(pp)
    clock = time.perf_counter
    waited_from = None  # when the rank began waiting for the next step (None: not timed)
    while True:
        payload = conn.recv_bytes()
        if payload == SHUTDOWN:
            break
        if payload == STATS:
            conn.send(("stats", counters.report(runner)))
            counters.reset()
            waited_from = None
            continue
        start = clock()
        if waited_from is not None:
            counters.between_seconds += start - waited_from
        batch = mirror.apply(pickle.loads(payload))
        handle = runner.launch(batch)
        mirror.on_launch(batch)
        tokens = handle.result()
        if runner.answers_engine:
            conn.send(("result", tokens, runner.h2d_totals()))
        waited_from = clock()
        counters.steps += 1
        counters.step_seconds += waited_from - start
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

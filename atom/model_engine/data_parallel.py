"""DataParallelEngine: `data_parallel_size` engine replicas behind one LLMEngine interface.

Each replica is a whole LLMEngine (its own scheduler, block manager and KV cache) whose
model runs on its own spawned ranks (tensor x pipeline parallel; one rank when both are
1), so the replicas compute at the same time. One TCPStore is bound before anything
spawns (port 0 on one node: no free-port race) and every rank of every replica is a
client of it; each replica's process group lives under its own key prefix
(`RendezvousSpec.replica_spec`), and on CUDA replica r's ranks take the GPUs after those
of replicas 0..r-1.

A request goes to the least-loaded replica (running + waiting requests; on a tie the one
that has served fewer, then the lowest index), so `LLM.generate` splits a batch of prompts across the replicas and still
returns the outputs in input order (it collects them by request). `step` steps every
replica that has work, each in its own thread (the threads mostly wait on their ranks'
pipes), and returns their outputs together.

Failure: a rank that dies in any replica fails the step with a WorkerFailedError that
names the replica, stage and rank; every replica is then stopped and the store's port
released.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from atom.config import Config
from atom.model_engine.context_length import resolve_max_model_len
from atom.model_engine.distributed_runner import (
    DistributedRunner,
    start_rendezvous,
    validate_parallelism,
)
from atom.model_engine.llm_engine import LLMEngine
from atom.model_engine.protocols import RunnerTotals
from atom.model_engine.rendezvous import Rendezvous
from atom.model_engine.sequence import Sequence
from atom.model_engine.step_outputs import StepOutput
from atom.models.default_model import default_model_path
from atom.models.loader import read_config
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class DataParallelEngine:
    """What LLM, AsyncEngine and /metrics use of an LLMEngine, over several replicas."""

    def __init__(self, config: Config):
        if config.node_rank > 0 or config.nnodes > 1:
            raise ValueError("data parallelism over several nodes is not supported yet")
        self.config = config
        self.model_path = config.model or default_model_path()
        hf_config = read_config(self.model_path)
        validate_parallelism(config, hf_config)  # before anything is bound or spawned
        max_model_len = resolve_max_model_len(config, hf_config)
        size, ranks = config.data_parallel_size, config.ranks_per_replica
        self.rendezvous = start_rendezvous(config, world_size=size * ranks)
        spec = self.rendezvous.spec
        runners: list[DistributedRunner] = []
        self.replicas: list[LLMEngine] = []
        try:
            for replica in range(size):  # spawn every replica first, then wait for all
                view = Rendezvous(
                    self.rendezvous.store,
                    spec.replica_spec(replica, ranks, config.pipeline_parallel_size),
                )
                runners.append(
                    DistributedRunner(
                        config, self.model_path, hf_config, max_model_len, view, wait=False
                    )
                )
            for runner in runners:
                runner.wait_ready()
            self.replicas = [LLMEngine(config, model_runner=runner) for runner in runners]
        except BaseException:
            for runner in runners:
                runner.shutdown()
            self.rendezvous.close()
            raise
        first = self.replicas[0]
        self.hf_config = first.hf_config
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self._replica_of: dict[int, int] = {}  # seq id -> replica index
        self._pool = ThreadPoolExecutor(size, thread_name_prefix="atom-dp")
        self.failure: BaseException | None = None
        self.requests = _Requests(self)
        self.stats = _SummedStats(self.replicas)
        self.scheduler = _JoinedSchedulers(self.replicas)
        self.block_manager = _SummedBlocks(self.replicas)
        self.model_runner: RunnerTotals = _Runners(self.replicas)
        logger.info(
            "data parallelism: %d replicas of %d rank(s), rendezvous at %s",
            size,
            ranks,
            spec.address,
        )

    # -- requests --------------------------------------------------------------------------
    def load(self, replica: int) -> int:
        """Requests running or waiting on `replica` (what routing balances)."""
        scheduler = self.replicas[replica].scheduler
        return len(scheduler.running) + len(scheduler.waiting)

    def add_request(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None
    ) -> int:
        self._raise_if_failed()
        # Least loaded; on a tie the one that has served fewer requests, then the lowest
        # index (so one-at-a-time traffic alternates too).
        replica = min(
            range(len(self.replicas)),
            key=lambda i: (self.load(i), self.replicas[i].stats.requests, i),
        )
        seq_id = self.replicas[replica].add_request(prompt, sampling_params)
        self._replica_of[seq_id] = replica
        return seq_id

    def replica_of(self, seq_id: int) -> int | None:
        return self._replica_of.get(seq_id)

    def abort(self, seq_id: int) -> bool:
        replica = self._replica_of.pop(seq_id, None)
        return replica is not None and self.replicas[replica].abort(seq_id)

    def has_unfinished(self) -> bool:
        return any(engine.has_unfinished() for engine in self.replicas)

    def tokenize(self, prompt):
        return self.replicas[0].tokenize(prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self.replicas[0].decode(token_ids)

    def output_of(self, seq: Sequence):
        return self.replicas[0].output_of(seq)

    def grammar_backend(self):
        return self.replicas[0].grammar_backend()

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step of every replica with work, concurrently; their outputs together."""
        self._raise_if_failed()
        busy = [engine for engine in self.replicas if engine.has_unfinished()]
        try:
            if len(busy) == 1:
                results = [busy[0].step()]
            else:
                futures = [self._pool.submit(engine.step) for engine in busy]
                results, errors = [], []
                for future in futures:
                    try:
                        results.append(future.result())
                    except BaseException as error:  # noqa: BLE001 - collected, raised below
                        errors.append(error)
                if errors:
                    raise errors[0]
        except BaseException as error:
            self.failure = error
            self.shutdown()
            raise
        outputs = [output for result in results for output in result]
        for output in outputs:
            if output.finished:
                self._replica_of.pop(output.seq_id, None)
        return outputs

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def shutdown(self) -> None:
        """Stop every replica's ranks, then release the store's port."""
        for engine in self.replicas:
            engine.shutdown()
        self._pool.shutdown(wait=False)
        self.rendezvous.close()


class _Requests(Mapping):
    """Live requests of every replica by seq id (LLM.generate looks them up)."""

    def __init__(self, engine: DataParallelEngine):
        self._engine = engine

    def _replica(self, seq_id):
        replica = self._engine.replica_of(seq_id)
        if replica is None:
            raise KeyError(seq_id)
        return self._engine.replicas[replica].requests

    def __getitem__(self, seq_id):
        return self._replica(seq_id)[seq_id]

    def __iter__(self):
        for engine in self._engine.replicas:
            yield from list(engine.requests)

    def __len__(self) -> int:
        return sum(len(engine.requests) for engine in self._engine.replicas)

    def pop(self, seq_id, default=None):
        try:
            return self._replica(seq_id).pop(seq_id, default)
        except KeyError:
            return default


class _SummedStats:
    """EngineStats summed over the replicas (each replica's own: `replicas[i].stats`)."""

    FIELDS = ("requests", "steps", "prompt_tokens", "generated_tokens", "step_seconds")

    def __init__(self, replicas):
        self._replicas = replicas

    def __getattr__(self, name):
        if name not in self.FIELDS:
            raise AttributeError(name)
        return sum(getattr(engine.stats, name) for engine in self._replicas)


class _JoinedSchedulers:
    """The replicas' running and waiting requests together (read-only)."""

    def __init__(self, replicas):
        self._replicas = replicas

    @property
    def running(self) -> list:
        return [seq for engine in self._replicas for seq in engine.scheduler.running]

    @property
    def waiting(self) -> list:
        return [seq for engine in self._replicas for seq in engine.scheduler.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(engine.scheduler.num_preemptions for engine in self._replicas)

    def has_unfinished(self) -> bool:
        return any(engine.scheduler.has_unfinished() for engine in self._replicas)


class _SummedBlocks:
    """KV blocks of every replica's cache together."""

    def __init__(self, replicas):
        self._replicas = replicas

    @property
    def num_blocks(self) -> int:
        return sum(engine.block_manager.num_blocks for engine in self._replicas)

    @property
    def num_free_blocks(self) -> int:
        return sum(engine.block_manager.num_free_blocks for engine in self._replicas)

    @property
    def usage(self) -> float:
        total = self.num_blocks
        return 0.0 if total == 0 else 1.0 - self.num_free_blocks / total

    @property
    def block_size(self) -> int:
        return self._replicas[0].block_manager.block_size

    @property
    def prefix_hit_blocks(self) -> int:
        return sum(engine.block_manager.prefix_hit_blocks for engine in self._replicas)

    @property
    def prefix_queried_blocks(self) -> int:
        return sum(engine.block_manager.prefix_queried_blocks for engine in self._replicas)

    @property
    def state_slots(self):
        """The replicas' state slots together (None: the model keeps no per-sequence state)."""
        slots = [engine.block_manager.state_slots for engine in self._replicas]
        return None if all(s is None for s in slots) else _SummedSlots(slots)


class _SummedSlots:
    """State slots of every replica together (read-only counts)."""

    def __init__(self, slots):
        self._slots = [s for s in slots if s is not None]

    @property
    def num_slots(self) -> int:
        return sum(s.num_slots for s in self._slots)

    @property
    def num_free(self) -> int:
        return sum(s.num_free for s in self._slots)


class _Runners:
    """The replicas' runners (RunnerTotals, protocols.py: counters only, since every
    replica launches its own steps); their runner slots live in the spawned ranks."""

    slots: tuple = ()

    def __init__(self, replicas):
        self.replicas = [engine.model_runner for engine in replicas]

    @property
    def num_kvcache_blocks(self) -> int:
        return sum(runner.num_kvcache_blocks for runner in self.replicas)

    def h2d_totals(self) -> tuple[int, int]:
        """Host-to-device copies and bytes of every replica (each its rank 0's)."""
        totals = [runner.h2d_totals() for runner in self.replicas]
        return sum(c for c, _ in totals), sum(b for _, b in totals)


def build_engine(config: Config) -> LLMEngine | DataParallelEngine:
    """The engine `config` asks for: replicas when data_parallel_size > 1."""
    if config.data_parallel_size > 1:
        return DataParallelEngine(config)
    return LLMEngine(config)

"""WorkerGroup: this node's ranks (tensor- and pipeline-parallel) as spawned processes,
watched by sentinel.

Each rank is a `torch.multiprocessing` *spawn* process (fork would copy CUDA and thread
state) running `target(local_rank, spec, conn, *args)` with one duplex pipe to the
parent: the parent sends step payloads (bytes, pickled once for all ranks), a rank
answers with small tuples: ("ready", info), ("result", value) or ("error", text).

Failures never hang the parent. While it waits for an answer it also waits on every
rank's process sentinel, so a rank that dies (an exception, SIGKILL, the OOM killer) is
seen at once; the parent then collects what the other ranks report for a moment (their
collectives fail after the death), stops them all, and raises WorkerFailedError naming
the rank that failed first and why. Ranks exit by themselves if the parent dies (their
pipe reads EOF) and are daemons, so none outlives the engine.

On a multi-node run the ranks of nodes > 0 are spawned there by `serve_remote_node`: it
forwards the step payloads it pops from a queue in the rendezvous store to its own
ranks, and writes any failure of its ranks to the store, where node 0 finds it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from multiprocessing import connection

import torch.distributed as dist
import torch.multiprocessing as mp

from atom.model_engine.rendezvous import Rendezvous, RendezvousSpec, connect

logger = logging.getLogger(__name__)

SHUTDOWN = b""  # the payload that tells every rank to stop
POLL_S = 0.5  # how often a waiting parent looks for failures reported by remote nodes
FAILURE_GRACE_S = 1.0  # how long to collect the other ranks' reports after a failure
FAILED_KEY = "failed/rank{}"  # store key of a remote rank's failure report


class WorkerFailedError(RuntimeError):
    """A rank died or raised; the message names it (replica, pipeline stage,
    tensor-parallel rank) and says why. `rank` is its rank in its replica's group."""

    def __init__(
        self,
        rank: int,
        reason: str,
        others: list[tuple[int, str]] = (),
        spec: RendezvousSpec | None = None,
    ):
        self.rank = rank
        self.reason = reason
        self.others = list(others)
        self.replica = spec.replica if spec is not None else None
        self.stage = rank // spec.tensor_parallel_size if spec is not None else 0
        name = spec.describe if spec is not None else (lambda r: f"tensor-parallel rank {r}")
        text = f"{name(rank)} {reason}"
        if self.others:
            text += "; after it: " + "; ".join(f"rank {r} {why}" for r, why in self.others)
        super().__init__(text + ". All workers were stopped; start a new engine.")


def step_queue(node_rank: int) -> str:
    """Store queue holding the step payloads for the ranks of `node_rank` (> 0)."""
    return f"steps/node{node_rank}"


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"died: killed by {name} (exit code {exitcode})"
    return f"died: exited with code {exitcode}"


def _looks_secondary(reason: str) -> bool:
    """A rank whose collective failed because a peer went away is a consequence."""
    text = reason.lower()
    return any(
        hint in text
        for hint in ("closed by peer", "connection reset", "broken pipe", "aborted", "timed out")
    )


def _worker_entry(target, local_rank: int, spec: RendezvousSpec, conn, args) -> None:
    # Ctrl-C reaches the whole process group; the parent decides how to stop the ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        target(local_rank, spec, conn, *args)
    except (EOFError, BrokenPipeError):
        pass  # the parent is gone: nobody to report to, just stop
    except BaseException as error:
        code = 1
        text = f"raised {type(error).__name__}: {error}"
        try:
            conn.send(("error", text, traceback.format_exc()))
        except (OSError, ValueError):
            pass
    # The target has cleaned up (process group destroyed). Skip the interpreter's
    # teardown of torch, which takes over a second per rank, and leave at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class WorkerGroup:
    """This node's ranks of one rendezvous. Owns the processes, their pipes and the
    Rendezvous (closed with them, which frees the store's port on node 0)."""

    def __init__(
        self,
        target,
        rendezvous: Rendezvous,
        args: tuple = (),
        name: str = "atom-tp",
        start_method: str = "spawn",
    ):
        """`start_method`: spawn (the engine's: safe with CUDA and threads); tests that
        only exercise the rendezvous may fork from a fresh process to start faster."""
        self.rendezvous = rendezvous
        self.spec = spec = rendezvous.spec
        self.ranks = [spec.global_rank(i) for i in range(spec.ranks_per_node)]
        self.processes: list[mp.Process] = []
        self.conns: list[connection.Connection] = []
        self._failures: list[tuple[int, str, bool]] = []  # (rank, reason, secondary)
        self._tracebacks: dict[int, str] = {}  # rank -> traceback of its exception
        self._exited: set[int] = set()  # local ranks whose exit was seen
        self._stopping = False  # SHUTDOWN was sent: a clean exit is no failure
        self._inbox: list[deque] = []  # per local rank: answers read while awaiting another
        self.failure: WorkerFailedError | None = None
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns, rendezvous, 5.0)
        context = mp.get_context(start_method)
        try:
            for local_rank, rank in enumerate(self.ranks):
                parent, child = context.Pipe(duplex=True)
                process = context.Process(
                    target=_worker_entry,
                    args=(target, local_rank, spec, child, args),
                    name=f"{name}-rank{rank}",
                    daemon=True,
                )
                process.start()
                child.close()
                self.processes.append(process)
                self.conns.append(parent)
                self._inbox.append(deque())
        except BaseException:
            self.shutdown(timeout_s=1.0)
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # -- talking to the ranks ----------------------------------------------------------------
    def send(self, payload: bytes) -> None:
        """The same payload to every rank of every node."""
        self._raise_if_failed()
        # A rank that died since the last step: fail now rather than write a large step to
        # a survivor that may be stuck in a collective with it and never read its pipe.
        for local_rank, process in enumerate(self.processes):
            if not process.is_alive():
                self._record_exit(local_rank)
        if self._failures:
            self._fail()
        self._stopping = payload == SHUTDOWN
        for local_rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._record_exit(local_rank)
                self._fail()
        store = self.rendezvous.store
        if self.spec.nnodes > 1 and self.rendezvous.is_master and store is not None:
            for node in range(1, self.spec.nnodes):
                store.queue_push(step_queue(node), payload)

    def receive(self, local_rank: int = 0):
        """The next ("ready" | "result", ...) message of a rank, watching all ranks."""
        self._raise_if_failed()
        inbox = self._inbox[local_rank]
        while not inbox:
            self._wait_once(POLL_S)
            if self._failures:
                self._fail()
        return inbox.popleft()

    def wait_ready(self) -> list:
        """The "ready" payload of every local rank, in rank order."""
        infos = []
        for local_rank in range(len(self.conns)):
            kind, info = self.receive(local_rank)[:2]
            if kind != "ready":
                raise RuntimeError(f"rank {self.ranks[local_rank]} sent {kind!r} before 'ready'")
            infos.append(info)
        return infos

    def wait_for_exit(self) -> None:
        """Block until every rank has exited cleanly (after SHUTDOWN); raise on a failure."""
        while any(p.is_alive() for p in self.processes):
            self._wait_once(POLL_S)
            if self._failures:
                self._fail()
        self.shutdown()

    # -- failures ----------------------------------------------------------------------------
    def _wait_once(self, timeout: float) -> None:
        """Wait for events: file answers in their rank's inbox, record failures."""
        sentinels = {}
        for local_rank, process in enumerate(self.processes):
            if process.is_alive():
                sentinels[process.sentinel] = local_rank
            elif local_rank not in self._exited:
                self._record_exit(local_rank)
        live_conns = [c for c in self.conns if not c.closed]
        ready = connection.wait(live_conns + list(sentinels), timeout)
        if not ready:
            self._check_remote_failures()
            return
        for item in ready:
            if item in sentinels:
                continue
            local_rank = self.conns.index(item)
            try:
                message = item.recv()
            except (EOFError, OSError):
                item.close()  # the rank is gone; its sentinel says how
                continue
            if message[0] == "error":
                self._record(self.ranks[local_rank], message[1])
                self._tracebacks[self.ranks[local_rank]] = message[2]
            else:
                self._inbox[local_rank].append(message)
        for item in ready:
            if item in sentinels:
                self._record_exit(sentinels[item])

    def _record(self, rank: int, reason: str) -> None:
        if any(r == rank for r, _, _ in self._failures):
            return
        self._failures.append((rank, reason, _looks_secondary(reason)))
        store = self.rendezvous.store
        if not self.rendezvous.is_master and store is not None:
            # A remote node publishes each failure at once; node 0 names it in its error.
            try:
                store.set(FAILED_KEY.format(rank), reason)
            except (RuntimeError, dist.DistError):
                pass  # node 0 is gone already

    def _record_exit(self, local_rank: int) -> None:
        self._exited.add(local_rank)
        process = self.processes[local_rank]
        process.join(timeout=1.0)
        if process.exitcode == 0:
            if self._stopping:
                return
            reason = "died: exited before the engine asked it to"
        else:
            reason = _exit_reason(process.exitcode)
        self._record(self.ranks[local_rank], f"(pid {process.pid}) {reason}")

    def _check_remote_failures(self) -> None:
        store = self.rendezvous.store
        if self.spec.nnodes == 1 or store is None:
            return
        for rank in range(self.spec.world_size):
            if rank in self.ranks:
                continue
            key = FAILED_KEY.format(rank)
            try:
                if store.check([key]):
                    self._record(rank, store.get(key).decode())
            except (RuntimeError, dist.DistError):
                # Node 0 closed its store: after its SHUTDOWN (a race with this poll), or
                # gone, which the step forwarder turns into a SHUTDOWN of this node's ranks
                # (serve_remote_node). Either way nothing is left to read.
                return

    def _fail(self) -> None:
        """Collect the other ranks' reports for a moment, stop everything, raise."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        while time.monotonic() < deadline:
            self._check_remote_failures()
            failed = {r for r, _, _ in self._failures}
            local_done = all(
                r in failed or not p.is_alive()
                for r, p in zip(self.ranks, self.processes, strict=True)
            )
            # Across nodes the root cause may be a remote rank: wait for its report.
            root_known = self.spec.nnodes == 1 or any(not f[2] for f in self._failures)
            if local_done and root_known:
                break
            self._wait_once(min(0.1, max(0.0, deadline - time.monotonic())))
        # The root cause first: a rank not failing because a peer vanished, earliest first.
        ordered = sorted(self._failures, key=lambda f: f[2])
        (rank, reason, _), others = ordered[0], [(r, why) for r, why, _ in ordered[1:]]
        self.failure = WorkerFailedError(rank, reason, others, self.spec)
        if rank in self._tracebacks:
            logger.error("%s failed:\n%s", self.spec.describe(rank), self._tracebacks[rank])
        self.shutdown(timeout_s=1.0)
        raise self.failure

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    # -- shutdown ----------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every rank (politely, then SIGTERM, then SIGKILL) and close the rendezvous."""
        if self._finalizer.detach() is not None:
            _stop(self.processes, self.conns, self.rendezvous, timeout_s)


def _stop(processes, conns, rendezvous: Rendezvous, timeout_s: float) -> None:
    for conn in conns:
        try:
            conn.send_bytes(SHUTDOWN)
        except (OSError, ValueError):
            pass
    store = rendezvous.store
    if store is not None and rendezvous.is_master and rendezvous.spec.nnodes > 1:
        for node in range(1, rendezvous.spec.nnodes):
            try:
                store.queue_push(step_queue(node), SHUTDOWN)
            except (RuntimeError, dist.DistError):
                pass
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=1.0)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()
    rendezvous.close()


def serve_remote_node(target, rendezvous: Rendezvous, args: tuple = ()) -> None:
    """Node-rank > 0 of a multi-node run: spawn this node's ranks, feed them the step
    payloads node 0 queues in the store, return once they stop; a failure is written to
    the store (node 0 reports it) and raised here too."""
    spec = rendezvous.spec
    group = WorkerGroup(target, rendezvous, args)
    inbox = connect(spec)  # its own client: the forwarding thread blocks on it
    waker = connect(spec)  # wakes that thread when this node stops first

    def forward() -> None:
        # Writes the pipes only; failures are the main thread's business (wait_for_exit).
        while True:
            try:
                payload = inbox.queue_pop(step_queue(spec.node_rank))
            except dist.DistStoreError:
                continue  # nothing queued for a while: an idle engine
            except (RuntimeError, dist.DistError):
                logger.warning("node 0 is gone (its store closed): stopping this node's ranks")
                payload = SHUTDOWN
            if payload == SHUTDOWN:
                group._stopping = True
            for conn in group.conns:
                try:
                    conn.send_bytes(payload)
                except (OSError, ValueError):
                    pass
            if payload == SHUTDOWN:
                return

    forwarder = threading.Thread(target=forward, name="atom-step-forwarder", daemon=True)
    forwarder.start()
    try:
        group.wait_for_exit()  # failures reach node 0 through the store (_record)
    finally:
        # A thread still blocked in the store's C++ client at interpreter exit aborts the
        # process: wake it with a SHUTDOWN of our own and let it finish first.
        if forwarder.is_alive():
            try:
                waker.queue_push(step_queue(spec.node_rank), SHUTDOWN)
            except (RuntimeError, dist.DistError):
                pass  # node 0 is gone: the thread has stopped or is about to
            forwarder.join(timeout=10.0)
        group.shutdown()

"""AsyncEngine: an LLMEngine stepped by one background thread, fed from asyncio.

The LLMEngine is not thread-safe, so exactly one thread (the engine thread) touches it.
Request handlers on the event loop never call it: they submit commands (add, abort)
that the engine thread runs between steps, in submission order. While any request is
alive the thread calls `LLMEngine.step()` back to back, so a request that arrives joins
the running batch at the next step (continuous batching); when none is alive the thread
sleeps until a command wakes it.

Step outputs travel back with `loop.call_soon_threadsafe`, once per step and event loop,
into each request's asyncio queue (`RequestStream`). A request that failed alone ends
with finish reason "error" like any other output; the thread stops only when `step`
raises (a device fault: docs/architecture.md, "Failure containment").
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Future

from atom.gc_heap import frozen_heap
from atom.model_engine.llm_engine import LLMEngine, StepOutput
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread failed or stopped; the request cannot complete."""


class RequestFailedError(RuntimeError):
    """This one request failed (finish reason "error"); the engine serves the others.
    The message is for the client: what failed, never a traceback."""


class RequestStream:
    """The StepOutputs of one request, in order, as an async iterator.

    Created on the event loop; filled by the engine thread through the loop.
    `seq_id` is set on the engine thread when the request is admitted.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.seq_id: int | None = None
        self.finished = False  # no more outputs wanted or coming (finished, aborted, failed)
        self._queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()

    def _put(self, item: StepOutput | BaseException) -> None:  # on the event loop
        self._queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # (command, future or None); `_accepting` turns False, under the lock, when the
        # thread exits, so no command can be queued that nobody will ever run.
        self._commands: queue.SimpleQueue[tuple[Callable[[], None], Future | None]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._accepting = False
        self._wakeup = threading.Event()
        self._streams: dict[int, RequestStream] = {}  # engine thread only
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why the engine thread died, if it did
        # Counters the /metrics endpoint reads (written by the engine thread only).
        self.finished_requests: Counter[str] = Counter()  # by finish reason
        self.steps = 0
        self.step_seconds = 0.0
        self.last_step_seconds = 0.0
        self.last_step_h2d_copies = 0
        self.last_step_h2d_bytes = 0

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="atom-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step; abort whatever is still alive."""
        if self._thread is None:
            return
        self._stop = True
        self._wakeup.set()
        self._thread.join(timeout)
        self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # -- called on the event loop -----------------------------------------------------------
    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams):
        """Queue a request; returns its RequestStream. Raises ValueError on bad input
        (the engine's own validation, e.g. a prompt longer than max_model_len)."""
        [stream] = await self.add_requests([(prompt_token_ids, params)])
        return stream

    async def add_requests(
        self,
        requests: list[tuple[list[int], SamplingParams]],
        streams: list[RequestStream] | None = None,
    ) -> list[RequestStream]:
        """Queue several requests in one engine command (one step boundary for all, not
        one each), all or none: if the engine refuses one, none stays queued. `streams`:
        made beforehand by the caller (one per request), e.g. to be read before admission."""
        loop = asyncio.get_running_loop()
        if streams is None:
            streams = [RequestStream(loop) for _ in requests]
        admitted: Future[None] = Future()

        def add() -> None:
            try:
                for stream, (prompt_token_ids, params) in zip(streams, requests, strict=True):
                    stream.seq_id = self.engine.add_request(prompt_token_ids, params)
                    self._streams[stream.seq_id] = stream
            except BaseException:
                for stream in streams:
                    stream.finished = True
                    if stream.seq_id is not None:
                        self._streams.pop(stream.seq_id, None)
                        if self.engine.abort(stream.seq_id):
                            self.finished_requests["abort"] += 1
                raise

        self._submit(add, admitted)
        try:
            await asyncio.wrap_future(admitted)
        except asyncio.CancelledError:
            for stream in streams:
                self.abort(stream)  # runs after `add` on the engine thread: nothing leaks
            raise
        return streams

    def abort(self, stream: RequestStream, reason: str = "abort") -> None:
        """Stop a request (client gone: abort; stop string seen: stop); its blocks are
        freed. Synchronous and cheap, so it can run in a `finally` of a cancelled task."""
        if stream.finished:
            return
        stream.finished = True

        def abort() -> None:
            if stream.seq_id is None:  # `add` failed: nothing to abort
                return
            self._streams.pop(stream.seq_id, None)
            if self.engine.abort(stream.seq_id):
                self.finished_requests[reason] += 1

        self._submit(abort)

    def _submit(self, command: Callable[[], None], done: Future | None = None) -> None:
        """Queue `command` for the engine thread; `done` receives its result or error."""
        with self._lock:
            if not self._accepting:
                if done is not None:
                    done.set_exception(EngineDeadError("the engine is not running"))
                return
            self._commands.put((command, done))
        self._wakeup.set()

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with frozen_heap():  # collections while it serves skip the start-up heap
                self._serve()
        except BaseException as error:
            # Only a device fault or an engine bookkeeping error gets here (LLMEngine.step
            # contains the failures of single requests): /health turns 503 at once.
            self.error = error
            logger.exception("the engine thread failed; failing every live request")
        finally:
            with self._lock:
                self._accepting = False
            self._run_commands(refuse=True)
            self._shut_down_requests()

    def _serve(self) -> None:
        while not self._stop:
            self._wakeup.clear()  # before draining: a later submit wakes the wait below
            self._run_commands()
            if not self.engine.has_unfinished():
                self._wakeup.wait()
                continue
            self._step()

    def _run_commands(self, refuse: bool = False) -> None:
        """Run queued commands in order; `refuse`: fail them instead (thread exit)."""
        while True:
            try:
                command, done = self._commands.get_nowait()
            except queue.Empty:
                return
            if done is not None and not done.set_running_or_notify_cancel():
                # Its caller was cancelled first (the client left during admission): the
                # command is not run, and its future takes no result.
                continue
            if refuse:
                if done is not None:
                    done.set_exception(EngineDeadError("the engine is not running"))
                continue
            try:
                command()
            except Exception as error:
                if done is None:  # an abort failed: the engine's state is in doubt
                    raise
                done.set_exception(error)  # e.g. ValueError: the handler answers 400
            else:
                if done is not None:
                    done.set_result(None)

    def _step(self) -> None:
        copies, nbytes = self.h2d_totals()
        steps = self.engine.stats.steps
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - start
        if self.engine.stats.steps != steps:  # a batch ran (not only a read-back)
            self.steps += 1
            self.step_seconds += seconds
            self.last_step_seconds = seconds
            copies_after, bytes_after = self.h2d_totals()
            self.last_step_h2d_copies = copies_after - copies
            self.last_step_h2d_bytes = bytes_after - nbytes
        elif not outputs:
            # Requests exist but none could be scheduled: wait for a command (an abort, a
            # new request) rather than spin.
            self._wakeup.wait(0.001)

        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for output in outputs:
            stream = self._streams.get(output.seq_id)
            if stream is None:  # aborted while its token was in flight
                continue
            if output.finished:
                del self._streams[output.seq_id]
                self.finished_requests[output.finish_reason or "unknown"] += 1
            by_loop[stream.loop].append((stream, output))
        for loop, items in by_loop.items():
            _deliver(loop, items)

    def _shut_down_requests(self) -> None:
        """Abort every request and fail its stream (thread exit: shutdown or a crash)."""
        error = EngineDeadError(
            "the server is shutting down" if self.error is None else "the engine failed"
        )
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for seq_id, stream in list(self._streams.items()):
            try:
                self.engine.abort(seq_id)
            except Exception:  # noqa: BLE001 - keep failing the other streams
                logger.exception("could not abort request %d", seq_id)
            by_loop[stream.loop].append((stream, error))
        self._streams.clear()
        for loop, items in by_loop.items():
            _deliver(loop, items)

    def h2d_totals(self) -> tuple[int, int]:
        """Cumulative host-to-device copies and bytes of the runner (under tensor
        parallelism: rank 0's, reported with each step's tokens)."""
        return self.engine.model_runner.h2d_totals()


def _deliver(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Hand a step's outputs to one event loop in one thread-safe call."""

    def put_all() -> None:
        for stream, item in items:
            stream._put(item)

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the loop closed (server shutting down): nobody is listening
        pass

"""Grammar compiles on a bounded pool of their own, each with a deadline.

A compile runs in xgrammar's C++ and cannot be interrupted. On the default executor an
abandoned compile held a thread that /tokenize and shutdown then waited for (7 of them
made /tokenize take 51 s and SIGTERM 50 s). Here compiles get `threads` daemon threads of
their own: a request waits at most `timeout` seconds; a compile that has not started by
then is dropped, one that runs on is abandoned (its thread finishes it, its result goes
into xgrammar's cache), and stopping the server never waits for either.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from atom.entrypoints.openai_errors import OpenAIError
from atom.entrypoints.request_limits import ServerBusyError


class GrammarCompilePool:
    def __init__(self, threads: int, timeout: float):
        self.timeout = timeout
        self._running = 0  # compiles in progress (read by `busy`)
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Future, Callable] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"atom-grammar-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, function: Callable) -> Future:
        future: Future = Future()
        self._jobs.put((future, function))
        return future

    async def run(self, function: Callable):
        """`function()` on the pool, within `timeout` seconds of being asked.

        Raises ServerBusyError (503) when it could not start in time (the pool is busy
        with other compiles) and OpenAIError (400, response_format) when it started but
        did not finish in time."""
        future = self.submit(function)
        started = time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
        except TimeoutError:
            if future.cancel():  # never started: nothing of it runs
                raise ServerBusyError(
                    f"every grammar compile thread stayed busy for {self.timeout:g} s "
                    f"(--grammar-compile-threads); retry later"
                ) from None
            raise OpenAIError(
                f"the json_schema did not compile within {self.timeout:g} s "
                f"(--grammar-compile-timeout); waited {time.monotonic() - started:.1f} s",
                param="response_format",
            ) from None
        except asyncio.CancelledError:
            future.cancel()  # the client left: drop it if it has not started
            raise

    @property
    def busy(self) -> bool:
        """Whether a compile is running (an abandoned one included)."""
        return self._running > 0

    def close(self) -> None:
        """Drop queued compiles; running ones finish on their daemon threads."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, function = job
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running += 1
            try:
                result = function()
            except BaseException as error:  # noqa: BLE001 - handed to the awaiting request
                future.set_exception(error)
            else:
                future.set_result(result)
            finally:
                with self._lock:
                    self._running -= 1

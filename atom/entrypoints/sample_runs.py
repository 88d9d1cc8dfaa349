"""A request's samples in the engine: admitted in shares, their text deltas merged as they
come, collected into whole answers or sent as Server-Sent Events.

Shared by the generation endpoints (openai_serving.py, and through it the Responses and
Anthropic APIs): what one request may hold in the engine at once (request_limits.py), the
admission of its later samples as earlier ones finish, the latency metrics of each sample,
and the abort of everything a request started when its client leaves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from atom.entrypoints.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
)
from atom.entrypoints.generation import TextDelta, text_deltas
from atom.entrypoints.metrics import RequestMetrics
from atom.entrypoints.openai_errors import SERVER_ERROR, OpenAIError, error_body
from atom.entrypoints.request_limits import Reservation
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"


class ClientDisconnected(Exception):
    pass


class SampleRuns:
    """Runs requests' samples in the engine (see the module docstring): at most
    ``samples_in_engine`` of one request at once; ``metrics`` observes each sample."""

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer,
        samples_in_engine: int,
        metrics: RequestMetrics | None = None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.samples_in_engine = samples_in_engine
        self.metrics = metrics

    async def add(self, prompt_ids, params) -> list[Choice]:
        """Admit a request's samples: the first at once, the rest as room frees up.

        Sample 0 of every prompt goes in one engine command (one step boundary, all or
        none: one refused prompt aborts the rest). n > 1: samples 1.. of a prompt are added
        once sample 0 has its first token, so its prompt's KV blocks are in the prefix
        cache and they share them (choice order: prompt by prompt, then sample by sample).

        A request holds at most `samples_in_engine` samples in the engine at once (waiting
        or running); the others join as earlier ones finish, behind whatever other
        clients queued meanwhile. So one large request cannot put all of its samples
        ahead of a later small one (first come, first served per share, not per body)."""
        loop = asyncio.get_running_loop()
        admission = Admission(asyncio.Semaphore(self.samples_in_engine))
        choices: list[Choice] = []
        firsts: list[tuple[Choice, list[int], SamplingParams]] = []
        later: list[tuple[Choice, list[int], SamplingParams]] = []
        for ids, p in zip(prompt_ids, params, strict=True):
            parent = Choice(RequestStream(loop), len(ids), admission=admission)
            choices.append(parent)
            firsts.append((parent, ids, p.for_sample(0)))
            for i in range(1, p.n):
                choice = Choice(RequestStream(loop), len(ids), admission=admission, parent=parent)
                choices.append(choice)
                later.append((choice, ids, p.for_sample(i)))
        now, rest = firsts[: self.samples_in_engine], firsts[self.samples_in_engine :] + later
        try:
            for choice, _, _ in now:
                await choice.take_slot()  # free: the window is new
            await self.engine.add_requests(
                [(ids, p) for _, ids, p in now], [choice.stream for choice, _, _ in now]
            )
        except BaseException as error:
            self.abort(choices)
            if isinstance(error, ValueError):
                raise OpenAIError(str(error)) from None
            if isinstance(error, EngineDeadError):
                raise engine_dead(error) from None
            raise
        if rest:
            admission.task = asyncio.ensure_future(self._admit_later(rest))
        return choices

    async def _admit_later(self, pending: list[tuple[Choice, list[int], SamplingParams]]) -> None:
        """Admit `pending` in order, each once its request has room (and, for samples
        1.., once their sample 0 has a token); ready ones go in one command."""
        queue = deque(pending)
        batch: list = []
        try:
            while queue:
                head = queue[0][0]
                if head.parent is not None:
                    await head.parent.started.wait()
                await head.take_slot()
                batch = [queue.popleft()]
                while queue and queue[0][0].ready_now():
                    await queue[0][0].take_slot()  # free: ready_now saw room
                    batch.append(queue.popleft())
                for choice, _, _ in batch:
                    if choice.stream.finished:  # aborted while it waited
                        choice.done()
                batch = [item for item in batch if not item[0].stream.finished]
                if batch:
                    await self.engine.add_requests(
                        [(ids, p) for _, ids, p in batch], [choice.stream for choice, _, _ in batch]
                    )
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - handed to the request's readers
            # Headers may be sent already: each sample not admitted ends with the error.
            if isinstance(error, ValueError):
                error = OpenAIError(str(error))
            for choice, _, _ in [*batch, *queue]:
                choice.stream._put(error)

    def abort(self, choices: list[Choice]) -> None:
        """Stop admitting a request's samples and abort those admitted (idempotent)."""
        for choice in choices:
            choice.stop_admission()
            self.engine.abort(choice.stream)

    async def merged_deltas(
        self, streams: list[Choice], stop: list[str], usage: Usage, keep_special=frozenset()
    ) -> AsyncIterator[tuple[int, TextDelta]]:
        """(choice index, delta) of all streams as they come; counts completion tokens.
        `keep_special`: special token ids kept in the text (generation.py)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, choice: Choice) -> None:
            timer = RequestTimer(self.metrics, choice.arrival)
            try:
                async with aclosing(
                    text_deltas(
                        self.engine,
                        choice.stream,
                        self.tokenizer,
                        stop,
                        choice.watched(),
                        keep_special=keep_special,
                    )
                ) as deltas:
                    async for delta in deltas:
                        timer.observe(delta, choice.prompt_tokens)
                        queue.put_nowait((index, delta))
            except Exception as error:  # noqa: BLE001 - re-raised by the reader below
                queue.put_nowait((index, error))
            finally:
                choice.done()

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.finish_reason is not None:
                    remaining -= 1
                    usage.completion_tokens += item.num_output_tokens
                yield index, item
        finally:
            for task in tasks:
                task.cancel()  # their text_deltas abort the requests

    async def collect(
        self, streams, stop, usage, raw: Request, keep_special=frozenset()
    ) -> list[Collected]:
        """What each stream produced; a client that goes away aborts them."""

        async def gather() -> list[Collected]:
            results = [Collected() for _ in streams]
            async for index, delta in self.merged_deltas(streams, stop, usage, keep_special):
                result = results[index]
                result.text += delta.text
                result.token_ids += delta.token_ids
                result.logprobs += delta.logprobs or []
                result.prompt_logprobs = result.prompt_logprobs or delta.prompt_logprobs
                result.finish_reason = delta.finish_reason or result.finish_reason
                if delta.num_kept_tokens is not None:  # a stop string cut the text
                    del result.token_ids[delta.num_kept_tokens :]
                    del result.logprobs[delta.num_kept_tokens :]
            return results

        try:
            return await unless_disconnected(raw, gather())
        except EngineDeadError as error:
            raise engine_dead(error) from None
        except RequestFailedError as error:  # this request alone: the engine goes on
            raise OpenAIError(str(error), status=500, type=SERVER_ERROR) from None
        finally:
            self.abort(streams)

    def event_stream(
        self, events: AsyncIterator[str], streams, reservation: Reservation
    ) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield event
            except (EngineDeadError, RequestFailedError) as error:
                yield sse(error_body(str(error), SERVER_ERROR))
            except Exception:
                # Headers are sent: report in the stream, the trace only in the log.
                logger.exception("a stream failed")
                yield sse(error_body("internal server error", SERVER_ERROR))
            finally:
                reservation.release()
            yield "data: [DONE]\n\n"

        def abort_all() -> None:
            # Also covers a client that left before the body started (its generator,
            # never entered, has no `finally` to run).
            self.abort(streams)
            reservation.release()

        return StreamingResponse(
            body(), media_type="text/event-stream", background=BackgroundTask(abort_all)
        )


@dataclass
class Admission:
    """The samples of one request in the engine: a window of slots, and the task that
    admits the samples that wait for one."""

    window: asyncio.Semaphore
    task: asyncio.Task | None = None


@dataclass
class Choice:
    """One choice's request: its stream (made before it is admitted), the admission it
    takes a slot of, and its sample 0 if it is a later sample of the same prompt."""

    stream: RequestStream
    prompt_tokens: int = 0
    admission: Admission | None = None
    parent: Choice | None = None
    arrival: float = field(default_factory=time.monotonic)
    started: asyncio.Event = field(default_factory=asyncio.Event)  # its first output came
    _holds_slot: bool = False

    async def take_slot(self) -> None:
        await self.admission.window.acquire()
        self._holds_slot = True

    def ready_now(self) -> bool:
        """Whether it could be admitted without waiting."""
        parent_ready = self.parent is None or self.parent.started.is_set()
        return parent_ready and not self.admission.window.locked()

    async def watched(self) -> AsyncIterator:
        """The stream's outputs; marks `started` at the first."""
        try:
            async for output in self.stream:
                self.started.set()
                yield output
        finally:
            self.done()

    def done(self) -> None:
        """The choice ended (finished, stopped, failed or aborted): free its slot, and
        let its other samples go in even if it never produced a token."""
        self.started.set()
        if self._holds_slot:
            self._holds_slot = False
            self.admission.window.release()

    def stop_admission(self) -> None:
        task = self.admission.task if self.admission is not None else None
        if task is not None:
            task.cancel()


class RequestTimer:
    """Observes one request's latencies and sizes into the server's histograms."""

    def __init__(self, metrics: RequestMetrics | None, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self.last: float | None = None

    def observe(self, delta: TextDelta, prompt_tokens: int) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        now = time.monotonic()
        if self.last is None:
            metrics.time_to_first_token.observe(now - self.arrival)
            if delta.queue_seconds is not None:
                metrics.queue_time.observe(max(0.0, delta.queue_seconds))
        else:
            metrics.inter_token_latency.observe(now - self.last)
        self.last = now
        if delta.finish_reason is not None:
            metrics.e2e_latency.observe(now - self.arrival)
            metrics.prompt_tokens.observe(prompt_tokens)
            metrics.generation_tokens.observe(delta.num_output_tokens)


@dataclass
class Collected:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: str | None = None


class Usage:
    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def engine_dead(error: EngineDeadError) -> OpenAIError:
    return OpenAIError(str(error), status=503, type=SERVER_ERROR)


async def unless_disconnected(raw: Request, work):
    """Await `work`, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()  # its text_deltas abort the requests
    raise ClientDisconnected()

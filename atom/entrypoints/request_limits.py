"""How much work one request may ask of the server, and how much the server takes at once.

A small body can ask for a lot: a 10 MB list of 2 million one-token prompts, 500 prompts
with n=64, a 50-byte regex that compiles for a minute. Each limit here is a server flag
(README "Server limits"); a request over one gets a 400 naming the field, and a server
that already holds `max_queued_samples` samples answers 503 with `Retry-After` instead of
queueing without end.

The request models (openai_protocol.py) read the limits of the server that is parsing
them through `current_limits()`: the `RequestLimitsContext` middleware sets them for
each request, so a list of two million prompts is refused by its length before any of
its members is validated.

Parsing itself is the other cost: `json.loads` of 10 MB holding two million small arrays
takes 1-2 s and holds the GIL throughout (a worker thread would not free the event
loop). So the middleware first counts a body's JSON arrays and objects with C-speed byte
scans (~30 ms for 10 MB) and refuses a body with more than `max_json_containers`
(no request within the other limits comes near it) before it is parsed.
"""

from __future__ import annotations

import argparse
import contextvars
import re
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from atom.entrypoints.openai_errors import SERVER_ERROR, OpenAIError, error_response
from atom.model_engine.grammar_limits import GrammarLimits

RETRY_AFTER_SECONDS = 1


@dataclass(frozen=True)
class ServerLimits:
    """Per-request caps and the server-wide admission bound (defaults: the server's)."""

    max_prompts_per_request: int = 256  # entries of a completion's prompt list
    max_samples_per_request: int = 1024  # prompts x n
    max_queued_samples: int = 4096  # samples held by all requests in progress
    max_json_containers: int = 100_000  # JSON arrays and objects in one request body
    # One request's samples in the engine at once (waiting or running); the rest join as
    # these finish. None: the engine's max_num_seqs.
    max_samples_in_engine_per_request: int | None = None
    grammar: GrammarLimits = GrammarLimits()

    def __post_init__(self) -> None:
        for name in (
            "max_prompts_per_request",
            "max_samples_per_request",
            "max_queued_samples",
            "max_json_containers",
            "max_samples_in_engine_per_request",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be at least 1, got {getattr(self, name)}")


_DEFAULT_LIMITS = ServerLimits()
_CURRENT: contextvars.ContextVar[ServerLimits | None] = contextvars.ContextVar(
    "atom_server_limits", default=None
)


def current_limits() -> ServerLimits:
    """The limits of the server handling the current request (defaults outside one)."""
    return _CURRENT.get() or _DEFAULT_LIMITS


class RequestLimitsContext:
    """ASGI middleware: `current_limits()` returns `limits` while a request is handled
    (FastAPI validates the body in the request's own task, so its validators see them),
    and a POST body with too many JSON containers is a 400 before it is parsed.

    Add it inside RequestSizeLimit, which then caps the body this one reads."""

    def __init__(self, app: ASGIApp, limits: ServerLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = _CURRENT.set(self.limits)
        try:
            if scope["type"] == "http" and scope["method"] == "POST":
                try:
                    body, first = await _read_body(receive)
                except HTTPException as error:  # over the size cap (RequestSizeLimit)
                    refusal = OpenAIError(str(error.detail), status=error.status_code)
                    response = error_response(refusal)
                    response.headers.update(error.headers or {})
                    await response(scope, receive, send)
                    return
                if first is None:  # the client left before its body arrived
                    return
                containers = json_containers(body, self.limits.max_json_containers)
                if containers > self.limits.max_json_containers:
                    refusal = OpenAIError(
                        f"the request body holds {containers} JSON arrays and objects; this "
                        f"server parses at most {self.limits.max_json_containers} "
                        f"(--max-json-containers)"
                    )
                    await error_response(refusal)(scope, receive, send)
                    return
                receive = _replay(first, receive)
            await self.app(scope, receive, send)
        finally:
            _CURRENT.reset(token)


async def _read_body(receive: Receive) -> tuple[bytes, Message | None]:
    """(the whole body, one message that replays it); None when the client left."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"", None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            body = b"".join(chunks)
            return body, {"type": "http.request", "body": body, "more_body": False}


def _replay(first: Message, receive: Receive) -> Receive:
    pending = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


# A JSON string, escapes included (the unrolled form: linear, no backtracking per char).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_containers(body: bytes, limit: int) -> int:
    """The number of `[` and `{` in `body` outside JSON strings (exact for valid JSON).
    The plain byte count is an upper bound; only above `limit` are strings removed to
    count exactly (brackets in prompt text must not count)."""
    count = body.count(b"[") + body.count(b"{")
    if count <= limit:
        return count
    outside = _JSON_STRING.sub(b"", body)
    return outside.count(b"[") + outside.count(b"{")


class ServerBusyError(OpenAIError):
    """503 with Retry-After: the server holds as many samples as it queues."""

    def __init__(self, message: str):
        super().__init__(message, status=503, type=SERVER_ERROR, code="server_busy")
        self.headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}


class AdmissionBudget:
    """Counts the samples of the requests in progress (event loop only, no lock needed).

    A request reserves its prompts x n before any tokenization or compile runs and gives
    them back when it ends, however it ends; one that would pass the bound is a 503, so
    a flood of requests costs each a cheap refusal, not a place in an endless queue."""

    def __init__(self, max_samples: int):
        self.max_samples = max_samples
        self.held = 0

    def reserve(self, samples: int) -> Reservation:
        if self.held + samples > self.max_samples:
            raise ServerBusyError(
                f"the server is busy: it holds {self.held} samples and queues at most "
                f"{self.max_samples} (--max-queued-samples); this request asks for "
                f"{samples}. Retry after {RETRY_AFTER_SECONDS} s"
            )
        self.held += samples
        return Reservation(self, samples)


class Reservation:
    def __init__(self, budget: AdmissionBudget, samples: int):
        self.budget = budget
        self.samples = samples

    def release(self) -> None:
        """Give the samples back (idempotent: every way out of a request calls it)."""
        self.budget.held -= self.samples
        self.samples = 0


def add_limit_args(group) -> None:
    """The limit flags (README: Server limits), added to `group` (an argument group or a
    parser)."""
    defaults, grammar = ServerLimits(), GrammarLimits()
    group.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=defaults.max_prompts_per_request,
        help="prompts in one /v1/completions request (a longer list is a 400)",
    )
    group.add_argument(
        "--max-samples-per-request",
        type=int,
        default=defaults.max_samples_per_request,
        help="prompts x n of one request (more is a 400)",
    )
    group.add_argument(
        "--max-queued-samples",
        type=int,
        default=defaults.max_queued_samples,
        help="samples of all requests in progress; a request past it gets 503 + Retry-After",
    )
    group.add_argument(
        "--max-samples-in-engine-per-request",
        type=int,
        default=None,
        help="one request's samples in the engine at once; its others join as these finish, "
        "behind later requests (default: --max-num-seqs)",
    )
    group.add_argument(
        "--max-json-containers",
        type=int,
        default=defaults.max_json_containers,
        help="JSON arrays and objects in one request body, counted before it is parsed",
    )
    group.add_argument(
        "--max-schema-bytes",
        type=int,
        default=grammar.max_schema_bytes,
        help="size of a response_format json_schema as JSON text",
    )
    group.add_argument(
        "--max-schema-depth",
        type=int,
        default=grammar.max_schema_depth,
        help="nesting depth of a json_schema (objects and arrays)",
    )
    group.add_argument(
        "--max-schema-repetition",
        type=int,
        default=grammar.max_repetition,
        help="largest count in a json_schema: a pattern's {n,m} (nested ones multiplied), "
        "minLength/maxLength, minItems/maxItems, minProperties/maxProperties",
    )
    group.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=grammar.compile_timeout_s,
        help="seconds a json_schema may take to compile (longer is a 400)",
    )
    group.add_argument(
        "--grammar-compile-threads",
        type=int,
        default=grammar.compile_threads,
        help="threads that compile grammars (their own pool)",
    )


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        max_prompts_per_request=args.max_prompts_per_request,
        max_samples_per_request=args.max_samples_per_request,
        max_queued_samples=args.max_queued_samples,
        max_json_containers=args.max_json_containers,
        max_samples_in_engine_per_request=args.max_samples_in_engine_per_request,
        grammar=GrammarLimits(
            max_schema_bytes=args.max_schema_bytes,
            max_schema_depth=args.max_schema_depth,
            max_repetition=args.max_schema_repetition,
            compile_timeout_s=args.grammar_compile_timeout,
            compile_threads=args.grammar_compile_threads,
        ),
    )

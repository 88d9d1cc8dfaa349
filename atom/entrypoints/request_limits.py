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
"""

from __future__ import annotations

import argparse
import contextvars
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from atom.entrypoints.openai_errors import SERVER_ERROR, OpenAIError
from atom.model_engine.grammar_limits import GrammarLimits

RETRY_AFTER_SECONDS = 1


@dataclass(frozen=True)
class ServerLimits:
    """Per-request caps and the server-wide admission bound (defaults: the server's)."""

    max_prompts_per_request: int = 256  # entries of a completion's prompt list
    max_samples_per_request: int = 1024  # prompts x n
    max_queued_samples: int = 4096  # samples held by all requests in progress
    grammar: GrammarLimits = GrammarLimits()

    def __post_init__(self) -> None:
        for name in ("max_prompts_per_request", "max_samples_per_request", "max_queued_samples"):
            if getattr(self, name) < 1:
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
    (FastAPI validates the body in the request's own task, so its validators see them)."""

    def __init__(self, app: ASGIApp, limits: ServerLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = _CURRENT.set(self.limits)
        try:
            await self.app(scope, receive, send)
        finally:
            _CURRENT.reset(token)


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


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    defaults, grammar = ServerLimits(), GrammarLimits()
    group = parser.add_argument_group("request limits (README: Server limits)")
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
        grammar=GrammarLimits(
            max_schema_bytes=args.max_schema_bytes,
            max_schema_depth=args.max_schema_depth,
            max_repetition=args.max_schema_repetition,
            compile_timeout_s=args.grammar_compile_timeout,
            compile_threads=args.grammar_compile_threads,
        ),
    )

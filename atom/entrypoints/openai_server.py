"""OpenAI-compatible HTTP server: `python -m atom.entrypoints.openai_server [--model ...]`.

    GET  /health                liveness (503 once the engine thread has died: a device fault)
    GET  /v1/models             the one served model
    POST /v1/completions        prompt text or token ids; stream with SSE
    POST /v1/chat/completions   messages through the model's chat template; stream with SSE
    POST /v1/responses          OpenAI's Responses API (atom/entrypoints/responses_api.py)
    GET  /v1/responses/{id}     a stored response (--responses-store-size, --responses-store-ttl)
    POST /v1/messages           Anthropic's Messages API (atom/entrypoints/anthropic_api.py)
    GET  /v1/models/{id}        the served model (404 for any other id)
    POST /tokenize, /detokenize vLLM's tokenizer endpoints; GET /version
    GET  /metrics               Prometheus text format (prometheus_client)

--api-key KEY (or ATOM_API_KEY) makes /v1/*, /docs and /openapi.json require
`Authorization: Bearer KEY` or `x-api-key: KEY` (atom/entrypoints/auth.py).

One LLMEngine, stepped by a background thread (AsyncEngine); requests join the running
batch as they arrive. Listens on loopback only unless --host says otherwise. Request
bodies over --max-request-body-mb get a 413; what one request may ask (prompts, samples,
json_schema cost) and how many samples wait server-wide are bounded by the flags in
request_limits.py (README: Server limits). Ctrl-C (SIGINT) or SIGTERM ends open streams
with an error event, then the process exits with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from atom import envs
from atom.entrypoints.anthropic_api import add_messages_routes
from atom.entrypoints.async_engine import AsyncEngine
from atom.entrypoints.auth import require_api_key
from atom.entrypoints.chat_output import ChatFormat
from atom.entrypoints.engine_args import add_engine_args, config_from_args
from atom.entrypoints.metrics import CONTENT_TYPE, MetricsRegistry
from atom.entrypoints.openai_errors import (
    SERVER_ERROR,
    OpenAIError,
    error_response,
    install_error_handlers,
)
from atom.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from atom.entrypoints.openai_serving import OpenAIServing
from atom.entrypoints.reasoning import REASONING_PARSERS
from atom.entrypoints.request_limits import (
    RequestLimitsContext,
    ServerLimits,
    add_limit_args,
    limits_from_args,
)
from atom.entrypoints.request_size import DEFAULT_MAX_REQUEST_BYTES, RequestSizeLimit
from atom.entrypoints.responses_api import (
    DEFAULT_STORE_SIZE,
    DEFAULT_STORE_TTL_S,
    ResponseStore,
    add_responses_routes,
)
from atom.entrypoints.sample_runs import CLIENT_CLOSED_REQUEST, ClientDisconnected
from atom.entrypoints.tokenizer_endpoints import add_tokenizer_routes
from atom.entrypoints.tool_parsers import TOOL_PARSERS
from atom.model_engine.data_parallel import build_engine
from atom.model_engine.llm_engine import LLMEngine
from atom.model_engine.rendezvous import RendezvousError
from atom.model_engine.workers import WorkerFailedError
from atom.models.loader import ModelLoadError

logger = logging.getLogger(__name__)


def create_app(
    engine: LLMEngine,
    model_name: str,
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    response_store: ResponseStore | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The ASGI app over `engine`; the engine thread runs for the app's lifespan.
    `max_request_bytes`: larger bodies get a 413 (atom/entrypoints/request_size.py).
    `limits`: per-request caps and the admission bound (atom/entrypoints/request_limits.py).
    `api_key`: /v1/* then needs `Authorization: Bearer <api_key>` (atom/entrypoints/auth.py).
    `response_store`: where /v1/responses keeps responses for previous_response_id.
    `tool_call_parser`, `reasoning_parser`: how chat answers are read (chat_output.py)."""
    async_engine = AsyncEngine(engine)
    registry = MetricsRegistry(async_engine, model_name)
    limits = limits or ServerLimits()
    serving = OpenAIServing(async_engine, model_name, registry.requests, limits)
    serving.chat_format = ChatFormat(serving._chat_template(), tool_call_parser, reasoning_parser)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        await serving.start()
        try:
            yield
        finally:
            async_engine.shutdown()
            serving.close()

    app = FastAPI(title="atom", lifespan=lifespan)
    app.state.engine = async_engine
    app.state.serving = serving
    install_error_handlers(app)
    # Inside the size cap (the last added runs first): it reads only what the cap allows.
    app.add_middleware(RequestLimitsContext, limits=limits)
    app.add_middleware(RequestSizeLimit, max_bytes=max_request_bytes)
    require_api_key(app, api_key)

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_alive:
            return error_response(
                OpenAIError("the engine is not running", status=503, type=SERVER_ERROR)
            )
        return Response(status_code=200)

    def model_card() -> dict:
        return {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "atom",
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    add_tokenizer_routes(app, serving, model_card)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        try:
            return await serving.completions(body, raw)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        try:
            return await serving.chat(body, raw)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    if response_store is None:  # (an empty store is falsy: it has a length)
        response_store = ResponseStore()
    add_responses_routes(app, serving, response_store)
    add_messages_routes(app, serving)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(registry.render(), media_type=CONTENT_TYPE)

    return app


class Server(uvicorn.Server):
    """uvicorn's server, ending open streams at once when asked to stop.

    uvicorn waits for open connections before the app's shutdown, so a long stream
    would hold Ctrl-C for the whole grace period and then be cancelled mid-write.
    Stopping the engine first ends every stream with an error event and `[DONE]`.

    uvicorn also raises a caught SIGINT again once it has shut down (a KeyboardInterrupt
    traceback); here the signal only stops the server and `run` returns, so `main` ends
    normally. `stop_signal` names the signal that stopped it, if one did.
    """

    def __init__(self, app: FastAPI, **config):
        super().__init__(uvicorn.Config(app, **config))
        self.engine: AsyncEngine = app.state.engine
        self.stop_signal: str | None = None
        if self.config.log_level in (None, "info", logging.INFO):
            # atom prints its own start and stop lines; uvicorn's lifecycle lines
            # ("Waiting for application shutdown." ...) stay for --log-level debug.
            logging.getLogger("uvicorn.error").setLevel(logging.WARNING)

    def handle_exit(self, sig: int, frame) -> None:
        self.stop_signal = signal.Signals(sig).name
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for connections
        else:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        await asyncio.to_thread(self.engine.shutdown)
        await super().shutdown(sockets)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free port (read it back with getsockname)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family)


def build_parser(
    prog: str | None = None, model_positional: bool = False
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_engine_args(parser, model_positional=model_positional)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback)")
    server.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    server.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: --model as given, or the file's name)",
    )
    server.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    server.add_argument(
        "--api-key",
        default=envs.api_key(),
        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1/*, /docs "
        "and /openapi.json (default: $ATOM_API_KEY; none: open)",
    )
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-request-body-mb",
        type=float,
        default=DEFAULT_MAX_REQUEST_BYTES / (1 << 20),
        help="larger request bodies get a 413 before they are read (MiB)",
    )
    add_limit_args(limits)
    responses = parser.add_argument_group("Responses API")
    responses.add_argument(
        "--responses-store-size",
        type=int,
        default=DEFAULT_STORE_SIZE,
        help="responses kept in memory for previous_response_id (0: none)",
    )
    responses.add_argument(
        "--responses-store-ttl",
        type=float,
        default=DEFAULT_STORE_TTL_S,
        help="seconds a stored response stays available",
    )
    chat = parser.add_argument_group("chat output")
    chat.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the format of the model's tool calls, read under tool_choice auto "
        "(default: from the chat template when it shows exactly one format)",
    )
    chat.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split <think>...</think> off into reasoning_content (default: off)",
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """`prog` set (`atom serve`): the model may be the first argument."""
    args = build_parser(prog, model_positional=prog is not None).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        limits = limits_from_args(args)
        store = ResponseStore(args.responses_store_size, args.responses_store_ttl)
        sock = bind_socket(args.host, args.port)  # first: a busy port fails before the load
        engine = build_engine(config_from_args(args))  # data parallelism: replicas
    except (ValueError, ModelLoadError, OSError, RendezvousError, WorkerFailedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    given = args.model or getattr(args, "model_path", None)
    model_name = args.served_model_name or given or Path(engine.model_path).stem
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host  # IPv6
    print(f"atom: serving {model_name} on http://{host}:{port}", file=sys.stderr, flush=True)
    app = create_app(
        engine,
        model_name,
        max_request_bytes=int(args.max_request_body_mb * (1 << 20)),
        api_key=args.api_key,
        limits=limits,
        response_store=store,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    server = Server(app, log_level=args.log_level, timeout_graceful_shutdown=5)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()  # tensor-parallel ranks and the rendezvous store go with it
    if server.stop_signal is not None:
        print(f"atom: shut down ({server.stop_signal})", file=sys.stderr, flush=True)
    if app.state.serving.grammar_pool.busy:
        # An abandoned grammar compile still runs in xgrammar's C++ on a daemon thread;
        # interpreter teardown under it can abort the process, and it cannot be stopped.
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A cap on request bodies: 413 before an oversized body is read, parsed or tokenized.

A body that declares its size (Content-Length) is refused before any of it is read; a
chunked body is counted as it arrives and refused once it passes the limit. Either way
the connection is closed, so the rest of the body is not read.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from atom.entrypoints.openai_errors import OpenAIError, error_response

DEFAULT_MAX_REQUEST_BYTES = 32 << 20
_CLOSE = {"Connection": "close"}


def too_large_message(limit: int) -> str:
    return (
        f"the request body is larger than this server's limit of {limit} bytes "
        f"({limit / (1 << 20):g} MiB; --max-request-body-mb)"
    )


class RequestSizeLimit:
    """ASGI middleware: HTTP request bodies over `max_bytes` get a 413 in OpenAI's shape."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            error = OpenAIError(too_large_message(self.max_bytes), status=413)
            response = error_response(error)
            response.headers.update(_CLOSE)
            await response(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException raised while reading the body on to
                    # the app's handler, which answers in OpenAI's shape.
                    raise HTTPException(413, too_large_message(self.max_bytes), headers=_CLOSE)
            return message

        await self.app(scope, counted_receive, send)

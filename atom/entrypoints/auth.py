"""API-key authentication: `--api-key KEY` (or `ATOM_API_KEY`).

With a key, every `/v1/*` request, and the API's own description (`/docs`, `/redoc`,
`/openapi.json`), needs `Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients send it;
otherwise it is a 401 in OpenAI's error shape (Anthropic's on /v1/messages). /health, /metrics, /version and the tokenizer endpoints stay open, as in
vLLM. Without a key the server is open, as before.

The scheme is case-insensitive (`bearer`, `BEARER`: RFC 7235). The key is compared as
UTF-8 bytes against the header's raw bytes, in constant time, so a non-ASCII key matches
a client that sends it in UTF-8 (the decoded header would be latin-1).
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request

from atom.entrypoints.anthropic_api import anthropic_error_response
from atom.entrypoints.openai_errors import INVALID_REQUEST, OpenAIError, error_response

# Paths that need the key: the API, and what describes it (FastAPI's generated pages).
_PROTECTED_PREFIXES = ("/v1", "/docs", "/redoc", "/openapi.json")


def _needs_key(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in _PROTECTED_PREFIXES)


def _given_keys(request: Request) -> list[bytes]:
    """The raw bytes after `Bearer ` in the Authorization header, and of x-api-key."""
    keys = []
    for name, value in request.headers.raw:
        name = name.lower()
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                keys.append(token.strip())
        elif name == b"x-api-key":
            keys.append(value.strip())
    return keys


def require_api_key(app: FastAPI, api_key: str | None) -> None:
    if not api_key:
        return
    expected = api_key.encode("utf-8")

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if request.method == "OPTIONS" or not _needs_key(request.url.path):
            return await call_next(request)
        given = _given_keys(request)
        # one of them must match; each is compared in constant time
        if not any([hmac.compare_digest(key, expected) for key in given]):
            error = OpenAIError(
                "invalid or missing API key: send the header 'Authorization: Bearer <key>' "
                "or 'x-api-key: <key>'",
                status=401,
                type=INVALID_REQUEST,
                code="invalid_api_key",
            )
            if request.url.path == "/v1/messages":
                return anthropic_error_response(error)
            return error_response(error)
        return await call_next(request)

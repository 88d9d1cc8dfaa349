"""API-key authentication: `--api-key KEY` (or `ATOM_API_KEY`).

With a key, every `/v1/*` request needs `Authorization: Bearer KEY`; otherwise it is a 401
in OpenAI's error shape. /health, /metrics, /version and the tokenizer endpoints stay
open, as in vLLM. Without a key the server is open, as before. Keys are compared in
constant time.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request

from atom.entrypoints.openai_errors import INVALID_REQUEST, OpenAIError, error_response


def require_api_key(app: FastAPI, api_key: str | None) -> None:
    if not api_key:
        return
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if request.method == "OPTIONS" or not request.url.path.startswith("/v1"):
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            error = OpenAIError(
                "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                status=401,
                type=INVALID_REQUEST,
                code="invalid_api_key",
            )
            return error_response(error)
        return await call_next(request)

"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can see goes through here: invalid requests are 400 (FastAPI's
422 for validation errors and malformed JSON included), an unknown model is 404, and
anything unexpected is a 500 with a generic message, its traceback only in the log.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"


class OpenAIError(Exception):
    """An error to report to the client as is (message, type, param, code)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code


def error_body(
    message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: OpenAIError) -> JSONResponse:
    body = error_body(error.message, error.type, error.param, error.code)
    # e.g. Retry-After on a 503 (request_limits.ServerBusyError)
    return JSONResponse(body, status_code=error.status, headers=getattr(error, "headers", None))


def _field_path(loc: tuple) -> str:
    """("body", "messages", 0, "role") -> "messages[0].role"."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """One readable message for pydantic's list of errors (malformed JSON included)."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        reason = (detail.get("ctx") or {}).get("error", "could not be parsed")
        return OpenAIError(f"the request body is not valid JSON: {reason}")
    parts, param = [], None
    for e in errors:
        path = _field_path(tuple(e.get("loc", ())))
        message = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            message = "unknown parameter (atom does not support it)"
        elif not path and e.get("type") == "missing":
            message = "empty; send a JSON object"
        parts.append(f"{path}: {message}" if path else f"request body: {message}")
        param = param or path or None
    return OpenAIError("; ".join(parts) or "invalid request", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Routing errors (unknown path 404, wrong method 405) in the same shape.
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        error = OpenAIError(str(exc.detail), status=exc.status_code, type=kind)
        response = error_response(error)
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        error = OpenAIError(
            "internal server error; the server log has the details",
            status=500,
            type=SERVER_ERROR,
        )
        return error_response(error)

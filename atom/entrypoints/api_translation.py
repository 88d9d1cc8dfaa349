"""What the Responses and Messages APIs share: a translated request run on the chat path.

Both APIs are translators (docs/apis.md): their request becomes a ChatCompletionRequest,
`OpenAIServing.chat` runs it as any chat request, and its JSON body or its SSE chunks
become the API's own objects. So the chat endpoint stays the one engine path.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from atom.entrypoints.openai_errors import OpenAIError, validation_error
from atom.entrypoints.openai_protocol import ChatCompletionRequest
from atom.entrypoints.openai_serving import OpenAIServing


def chat_request(body: dict, param_names: dict[str, str]) -> ChatCompletionRequest:
    """The chat request for a translated `body`; a value the chat API refuses is a 400 that
    names the field as the client spelled it (`param_names`: chat's name -> the API's)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as error:
        raise rename_param(validation_error(error), param_names) from None


def rename_param(error: OpenAIError, param_names: dict[str, str]) -> OpenAIError:
    """`error` with chat's field names (e.g. messages[1].content) in the API's names."""
    if error.param:
        head, dot, rest = error.param.partition(".")
        base, bracket, index = head.partition("[")
        if base in param_names:
            error.param = param_names[base] + bracket + index + dot + rest
            error.message = error.message.replace(head, error.param.partition(".")[0], 1)
    return error


async def run_chat(
    serving: OpenAIServing, request: ChatCompletionRequest, raw: Request, names: dict[str, str]
) -> dict | ChatStream:
    """The chat result: its JSON body, or its stream. A refused request raises OpenAIError
    with the API's field names."""
    try:
        response = await serving.chat(request, raw)
    except OpenAIError as error:
        raise rename_param(error, names) from None
    if isinstance(response, JSONResponse):
        return json.loads(response.body)
    assert isinstance(response, StreamingResponse)
    return ChatStream(response)


class ChatStream:
    """A chat stream read as dicts, re-sent as another API's events by `respond`."""

    def __init__(self, response: StreamingResponse):
        self.response = response

    async def chunks(self) -> AsyncIterator[dict]:
        """The `data:` payloads (an `{"error": ...}` one included), up to `[DONE]`."""
        async with aclosing(self.response.body_iterator) as events:
            async for event in events:
                text = event.decode() if isinstance(event, bytes) else event
                payload = text.removeprefix("data: ").strip()
                if payload == "[DONE]":
                    return
                yield json.loads(payload)

    def respond(self, events: AsyncIterator[str]) -> StreamingResponse:
        # The chat stream's background task aborts its requests once the response ends,
        # also when the client left before the body started.
        return StreamingResponse(
            events, media_type="text/event-stream", background=self.response.background
        )


def sse_event(name: str, payload: dict) -> str:
    """One Server-Sent Event with its name: both APIs' SDKs dispatch on it."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n"

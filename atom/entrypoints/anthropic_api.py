"""Anthropic's Messages API, `POST /v1/messages`, translated onto the chat path.

`system` and `messages` (text, `tool_use` and `tool_result` blocks) become chat messages,
`tools` / `tool_choice` chat tools; the chat result becomes a `message`, and a chat stream
the Messages events the anthropic SDK parses (message_start, content_block_start,
content_block_delta, content_block_stop, message_delta, message_stop). Errors are in
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`. See docs/apis.md.

A stream's `message_start` reports 0 input tokens: the chat stream counts them only at its
end, and the final `message_delta` carries both counts (the SDK takes both from it).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from atom.entrypoints.api_translation import ChatStream, chat_request, run_chat, sse_event
from atom.entrypoints.openai_errors import OpenAIError, validation_error
from atom.entrypoints.openai_serving import OpenAIServing
from atom.entrypoints.sample_runs import CLIENT_CLOSED_REQUEST, ClientDisconnected
from atom.entrypoints.sampling_request import UnicodeChecked

logger = logging.getLogger(__name__)

_PARAM_NAMES = {"stop": "stop_sequences", "tool_choice": "tool_choice"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. cache_control, citations
    type: Literal["text"]
    text: StrictStr


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock] = ""
    is_error: StrictBool = False

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else _joined(self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: StrictStr | Annotated[list[Block], Field(min_length=1)]

    def chat_messages(self) -> list[dict]:
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        # Tool results answer the previous turn's calls: they come first, as tool messages.
        messages = [
            {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text}
            for block in self.content
            if isinstance(block, ToolResultBlock)
        ]
        text = _joined(b for b in self.content if isinstance(b, TextBlock))
        calls = [
            {
                "id": block.id,
                "type": "function",
                "function": {"name": block.name, "arguments": json.dumps(block.input)},
            }
            for block in self.content
            if isinstance(block, ToolUseBlock)
        ]
        if calls:
            messages.append({"role": self.role, "content": text or None, "tool_calls": calls})
        elif text or not messages:
            messages.append({"role": self.role, "content": text})
        return messages


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class MessagesRequest(UnicodeChecked):
    model_config = ConfigDict(extra="allow")  # metadata, service_tier...: ignored
    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # Anthropic's range
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    stream: StrictBool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError("must be a number")
        return value

    def chat_body(self) -> dict:
        system = self.system if isinstance(self.system, str) else _joined(self.system or [])
        messages = [{"role": "system", "content": system}] if system else []
        for message in self.messages:
            messages.extend(message.chat_messages())
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "parameters": tool.input_schema,
                        **({"description": tool.description} if tool.description else {}),
                    },
                }
                for tool in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool" and not choice.name:
                raise OpenAIError('tool_choice of type "tool" needs a name', param="tool_choice")
            body["tool_choice"] = {
                "auto": "auto",
                "any": "required",
                "none": "none",
                "tool": {"type": "function", "function": {"name": choice.name}},
            }[choice.type]
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        return body


def _joined(blocks) -> str:
    return "".join(block.text for block in blocks)


def anthropic_error_response(error: OpenAIError) -> JSONResponse:
    kind = _ERROR_TYPES.get(error.status, "api_error")
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=error.status)


def _tool_use_block(call: dict) -> dict:
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"] or "{}")
    except json.JSONDecodeError:
        arguments = {}  # not JSON: the tool parser keeps such output as text instead
    return {"type": "tool_use", "id": call["id"], "name": function["name"], "input": arguments}


class MessagesAPI:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create(self, raw: Request) -> Response:
        try:
            payload = json.loads(await raw.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise OpenAIError(f"the request body is not valid JSON: {error}") from None
        try:
            request = MessagesRequest.model_validate(payload)
        except ValidationError as error:
            raise validation_error(error) from None
        chat = chat_request(request.chat_body(), _PARAM_NAMES)
        result = await run_chat(self.serving, chat, raw, _PARAM_NAMES)
        message_id = f"msg_{uuid.uuid4().hex}"
        if isinstance(result, ChatStream):
            return result.respond(self._events(message_id, result))
        choice = result["choices"][0]
        message = choice["message"]
        content = [{"type": "text", "text": message["content"]}] if message.get("content") else []
        content += [_tool_use_block(call) for call in message.get("tool_calls") or []]
        usage = result["usage"]
        body = self._message(message_id, content, choice["finish_reason"])
        body["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
        }
        return JSONResponse(body)

    def _message(self, message_id: str, content: list[dict], finish_reason: str | None) -> dict:
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": self.serving.model_name,
            "content": content,
            "stop_reason": _STOP_REASONS.get(finish_reason) if finish_reason else None,
            "stop_sequence": None,
        }

    async def _events(self, message_id: str, stream: ChatStream) -> AsyncIterator[str]:
        start = self._message(message_id, [], None)
        start["usage"] = {"input_tokens": 0, "output_tokens": 0}
        yield sse_event("message_start", {"type": "message_start", "message": start})
        block = -1  # index of the open content block
        text_open = False
        call_blocks: dict[int, int] = {}  # chat tool-call index -> block index
        finish_reason, usage = None, None
        async for chunk in stream.chunks():
            if "error" in chunk:
                error = {"type": "api_error", "message": chunk["error"]["message"]}
                yield sse_event("error", {"type": "error", "error": error})
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content"):
                    if not text_open:
                        block, text_open = block + 1, True
                        yield _block_start(block, {"type": "text", "text": ""})
                    yield _block_delta(block, {"type": "text_delta", "text": delta["content"]})
                for call in delta.get("tool_calls") or []:
                    if call["index"] not in call_blocks:
                        if block >= 0:
                            yield _block_stop(block)
                        text_open = False
                        block += 1
                        call_blocks[call["index"]] = block
                        function = call.get("function") or {}
                        yield _block_start(
                            block,
                            {"type": "tool_use", "id": call.get("id") or "",
                             "name": function.get("name") or "", "input": {}},
                        )  # fmt: skip
                    arguments = (call.get("function") or {}).get("arguments")
                    if arguments:
                        yield _block_delta(
                            call_blocks[call["index"]],
                            {"type": "input_json_delta", "partial_json": arguments},
                        )
                finish_reason = choice.get("finish_reason") or finish_reason
        if block >= 0:
            yield _block_stop(block)
        counts = {"output_tokens": 0}
        if usage is not None:
            counts = {
                "input_tokens": usage["prompt_tokens"],
                "output_tokens": usage["completion_tokens"],
            }
        stop = {"stop_reason": _STOP_REASONS.get(finish_reason), "stop_sequence": None}
        yield sse_event("message_delta", {"type": "message_delta", "delta": stop, "usage": counts})
        yield sse_event("message_stop", {"type": "message_stop"})


def _block_start(index: int, block: dict) -> str:
    event = {"type": "content_block_start", "index": index, "content_block": block}
    return sse_event("content_block_start", event)


def _block_delta(index: int, delta: dict) -> str:
    event = {"type": "content_block_delta", "index": index, "delta": delta}
    return sse_event("content_block_delta", event)


def _block_stop(index: int) -> str:
    return sse_event("content_block_stop", {"type": "content_block_stop", "index": index})


def add_messages_routes(app: FastAPI, serving: OpenAIServing) -> None:
    api = MessagesAPI(serving)

    # The body is read here, not by FastAPI, so that every error (malformed JSON and
    # validation included) is in Anthropic's shape rather than the app's OpenAI one.
    @app.post("/v1/messages")
    async def create_message(raw: Request) -> Response:
        try:
            return await api.create(raw)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except OpenAIError as error:
            return anthropic_error_response(error)
        except Exception:
            logger.exception("/v1/messages failed")
            error = OpenAIError("internal server error; the server log has the details", 500)
            return anthropic_error_response(error)

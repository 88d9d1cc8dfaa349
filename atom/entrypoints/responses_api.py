"""OpenAI's Responses API, `POST /v1/responses`, translated onto the chat path.

`input` (a string, or a list of messages and items) and `instructions` become chat
messages; `previous_response_id` prepends the stored conversation of an earlier response
(a bounded in-memory store with expiry: --responses-store-size, --responses-store-ttl).
The chat result becomes a `response` object, and a chat stream becomes the Responses
events the openai SDK parses (response.created ... response.completed). See docs/apis.md.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
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
from atom.entrypoints.openai_errors import OpenAIError
from atom.entrypoints.openai_serving import OpenAIServing
from atom.entrypoints.sample_runs import CLIENT_CLOSED_REQUEST, ClientDisconnected
from atom.entrypoints.sampling_request import UnicodeChecked, valid_unicode

DEFAULT_STORE_SIZE = 1000  # responses kept for previous_response_id
DEFAULT_STORE_TTL_S = 3600.0

# chat's field names -> the Responses API's, for 400s that name the client's field
_PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens"}
# sampling fields passed to the chat request as they are (vLLM's extensions included)
_SAMPLING_FIELDS = ("top_k", "seed", "user", "stop", "min_tokens", "stop_token_ids", "ignore_eos")


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[InputText]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """A function call the model made (sent back in the input of the next turn)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr


_ITEM_TYPES = {
    "message": InputMessage,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


def _input_items(value: Any) -> str | list[BaseModel]:
    """`input` as text or items; one message naming the item (not pydantic's error for
    every member of the union)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string or a non-empty list of messages and items")
    items = []
    for index, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in _ITEM_TYPES:
            raise ValueError(
                f"item {index}: must be an object whose type is one of {sorted(_ITEM_TYPES)}"
            )
        try:
            items.append(_ITEM_TYPES[kind].model_validate(item))
        except ValidationError as error:
            details = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()
            )
            raise ValueError(f"item {index} ({kind}): {details}") from None
    return items


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ResponsesRequest(UnicodeChecked):
    # Unknown fields (metadata, reasoning, truncation...) are ignored, as the chat API does.
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    input: Any  # text, or a list of InputMessage / FunctionCallItem / FunctionCallOutputItem
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Any = None  # checked by the chat request (a 400 naming the field)
    top_p: Any = None
    stream: StrictBool = False
    store: StrictBool = True
    text: TextOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        return _input_items(valid_unicode(value))

    def messages(self) -> list[dict]:
        """This turn's input as chat messages (the instructions are not part of it: they
        do not carry over to a response that continues this one, as in OpenAI's API)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict] = []
        for item in self.input:
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                if (
                    messages
                    and messages[-1]["role"] == "assistant"
                    and "tool_calls" in messages[-1]
                ):
                    messages[-1]["tool_calls"].append(call)  # parallel calls: one message
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                )
        return messages

    def chat_body(self, history: list[dict], stream: bool) -> dict:
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            "model": self.model,
            "messages": system + history + self.messages(),
            "max_tokens": self.max_output_tokens,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        extra = self.model_extra or {}
        body.update({name: extra[name] for name in _SAMPLING_FIELDS if name in extra})
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.text is not None and self.text.format is not None:
            body["response_format"] = _response_format(self.text.format)
        if self.tools:
            body["tools"] = [_chat_tool(tool, index) for index, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        return body


def _response_format(text_format: TextFormat) -> dict:
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    if text_format.json_schema is None:
        raise OpenAIError('text.format of type "json_schema" needs a schema', param="text.format")
    schema = {"name": text_format.name or "response", "schema": text_format.json_schema}
    return {"type": "json_schema", "json_schema": schema}


def _chat_tool(tool: dict, index: int) -> dict:
    """A Responses function tool ({type, name, parameters}) as a chat tool."""
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise OpenAIError(
            'only function tools ({"type": "function", "name": ...}) are supported',
            param=f"tools[{index}]",
        )
    function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


class ResponseStore:
    """Conversations of finished responses for `previous_response_id`: at most `size`,
    each for `ttl_s` seconds (least recently stored evicted first). In memory only: a
    restart forgets them, and one server process owns them."""

    def __init__(self, size: int = DEFAULT_STORE_SIZE, ttl_s: float = DEFAULT_STORE_TTL_S):
        if size < 0 or ttl_s <= 0:
            raise ValueError(
                f"--responses-store-size must be >= 0 and --responses-store-ttl > 0, "
                f"got {size} and {ttl_s}"
            )
        self.size = size
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[float, list[dict], dict]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict], response: dict) -> None:
        if self.size == 0:
            return
        self._entries[response_id] = (time.monotonic() + self.ttl_s, messages, response)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[list[dict], dict]:
        """(conversation, response object); an unknown or expired id is a 404."""
        entry = self._entries.get(response_id)
        if entry is not None and entry[0] <= time.monotonic():
            del self._entries[response_id]
            entry = None
        if entry is None:
            raise OpenAIError(
                f"no stored response with id `{response_id}` (unknown, expired after "
                f"{self.ttl_s:g} s, or evicted: the server keeps {self.size})",
                status=404,
                type="not_found_error",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return entry[1], entry[2]

    def __len__(self) -> int:
        return len(self._entries)


class ResponsesAPI:
    def __init__(self, serving: OpenAIServing, store: ResponseStore):
        self.serving = serving
        self.store = store

    async def create(self, request: ResponsesRequest, raw: Request) -> Response:
        history: list[dict] = []
        if request.previous_response_id is not None:
            history, _ = self.store.get(request.previous_response_id)
        chat = chat_request(request.chat_body(history, request.stream), _PARAM_NAMES)
        result = await run_chat(self.serving, chat, raw, _PARAM_NAMES)
        head = self._head(request)
        conversation = history + request.messages()
        if isinstance(result, ChatStream):
            return result.respond(self._events(request, head, conversation, result))
        choice = result["choices"][0]
        output = _output_items(choice["message"])
        body = _response(head, "completed", output, choice["finish_reason"], result["usage"])
        self._keep(request, body, conversation, choice["message"])
        return JSONResponse(body)

    def _head(self, request: ResponsesRequest) -> dict:
        return {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "model": self.serving.model_name,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "tools": request.tools or [],
            "tool_choice": request.tool_choice or "auto",
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "text": {"format": {"type": "text"}},
            "store": request.store,
            "metadata": request.model_extra.get("metadata") or {},
        }

    def _keep(self, request, body: dict, conversation: list[dict], message: dict) -> None:
        if request.store:
            reply = {"role": "assistant", "content": message.get("content") or ""}
            if message.get("tool_calls"):
                reply["tool_calls"] = message["tool_calls"]
            self.store.put(body["id"], conversation + [reply], body)

    async def _events(
        self, request, head: dict, conversation: list[dict], stream: ChatStream
    ) -> AsyncIterator[str]:
        events = _EventWriter()
        yield events.send("response.created", response=_response(head, "in_progress", []))
        yield events.send("response.in_progress", response=_response(head, "in_progress", []))
        message_id = f"msg_{uuid.uuid4().hex}"
        text, calls, finish_reason, usage = "", {}, None, None
        text_open = False
        async for chunk in stream.chunks():
            if "error" in chunk:
                error = chunk["error"]
                yield events.send("error", code=error.get("code"), message=error["message"],
                                  param=error.get("param"))  # fmt: skip
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content"):
                    if not text_open:
                        text_open = True
                        item = _message_item(message_id, "", "in_progress")
                        item["content"] = []
                        yield events.send("response.output_item.added", output_index=0, item=item)
                        yield events.send("response.content_part.added", item_id=message_id,
                                          output_index=0, content_index=0,
                                          part=_text_part(""))  # fmt: skip
                    text += delta["content"]
                    yield events.send("response.output_text.delta", item_id=message_id,
                                      output_index=0, content_index=0, delta=delta["content"],
                                      logprobs=[])  # fmt: skip
                for call in delta.get("tool_calls") or []:
                    entry = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                    function = call.get("function") or {}
                    entry["id"] = call.get("id") or entry["id"]
                    entry["name"] += function.get("name") or ""
                    entry["arguments"] += function.get("arguments") or ""
                finish_reason = choice.get("finish_reason") or finish_reason
        output = []
        if text_open:
            yield events.send("response.output_text.done", item_id=message_id, output_index=0,
                              content_index=0, text=text, logprobs=[])  # fmt: skip
            yield events.send("response.content_part.done", item_id=message_id, output_index=0,
                              content_index=0, part=_text_part(text))  # fmt: skip
            item = _message_item(message_id, text)
            output.append(item)
            yield events.send("response.output_item.done", output_index=0, item=item)
        message = {"content": text, "tool_calls": []}
        for _, call in sorted(calls.items()):
            index = len(output)
            item = _function_call_item(call["id"], call["name"], call["arguments"])
            message["tool_calls"].append(
                {"id": call["id"], "type": "function",
                 "function": {"name": call["name"], "arguments": call["arguments"]}}
            )  # fmt: skip
            added = {**item, "status": "in_progress", "arguments": ""}
            yield events.send("response.output_item.added", output_index=index, item=added)
            yield events.send("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=index, delta=call["arguments"])  # fmt: skip
            yield events.send("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, arguments=call["arguments"])  # fmt: skip
            yield events.send("response.output_item.done", output_index=index, item=item)
            output.append(item)
        body = _response(head, "completed", output, finish_reason, usage)
        self._keep(request, body, conversation, message)
        yield events.send(f"response.{body['status']}", response=body)


class _EventWriter:
    """Responses events: each names its type and carries a rising sequence_number."""

    def __init__(self):
        self.sequence_number = 0

    def send(self, name: str, **fields) -> str:
        payload = {"type": name, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse_event(name, payload)


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(message_id: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": message_id,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)],
    }


def _function_call_item(call_id: str, name: str, arguments: str) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _output_items(message: dict) -> list[dict]:
    output = []
    if message.get("content"):
        output.append(_message_item(f"msg_{uuid.uuid4().hex}", message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        output.append(_function_call_item(call["id"], function["name"], function["arguments"]))
    return output


def _response(
    head: dict,
    status: str,
    output: list[dict],
    finish_reason: str | None = None,
    usage: dict | None = None,
) -> dict:
    """The response object; a chat `length` finish is OpenAI's `incomplete` status."""
    incomplete = None
    if finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    body = {**head, "status": status, "incomplete_details": incomplete, "error": None}
    body["output"] = output
    body["usage"] = None
    if usage is not None:
        body["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }
    return body


def add_responses_routes(app: FastAPI, serving: OpenAIServing, store: ResponseStore) -> None:
    api = ResponsesAPI(serving, store)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        try:
            return await api.create(body, raw)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        try:
            return JSONResponse(store.get(response_id)[1])
        except OpenAIError as error:
            error.param = "response_id"
            raise

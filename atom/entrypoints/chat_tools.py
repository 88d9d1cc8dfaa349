"""Tools in /v1/chat/completions: the request's shapes, its checks, and tool_choice as a
structured-output constraint.

`required` and a named function are enforced with the server's xgrammar structured
output: the output is constrained to JSON (`tool_constraint`), so the arguments always
parse and match the function's schema, whatever the model. The output is then that JSON:
a named choice generates the arguments object, `required` an array of
`{"name": ..., "parameters": {...}}` (`forced_call_parser` reads both). `auto` leaves the
model free and reads its calls with the server's tool-call parser (tool_parsers/).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from atom.entrypoints.tool_parsers.base import (
    Scan,
    ToolCall,
    ToolParser,
    json_value_end,
    read_call_object,
    skip_whitespace,
)
from atom.sampling_params import SamplingParamError

# Arrays and objects nested in one tool's schema. Checking a schema recurses (jsonschema's
# meta-schema check overflowed Python's stack at ~200 levels: a 500), so deeper ones are
# refused first. A forced tool_choice's schema then also meets the server's json_schema
# limits when it is compiled (its size, depth and counts).
MAX_TOOL_SCHEMA_DEPTH = 64


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _valid_schema(cls, schema: dict | None) -> dict | None:
        if schema is not None:
            check_json_schema(schema)
        return schema

    @property
    def arguments_schema(self) -> dict:
        """The arguments' JSON schema (any object when the tool gives none)."""
        return self.parameters if self.parameters is not None else {"type": "object"}


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr


class NamedToolChoice(BaseModel):
    """{"type": "function", "function": {"name": ...}}: call this function."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    arguments: StrictStr


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history (as the server returned it)."""

    model_config = ConfigDict(extra="allow")
    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


def check_json_schema(schema: dict) -> None:
    """Raise ValueError when `schema` is not a JSON Schema (jsonschema's meta-schema
    check, after a bound on its nesting)."""
    depth = _nesting_depth(schema)
    if depth > MAX_TOOL_SCHEMA_DEPTH:
        raise ValueError(
            f"nested {depth} levels deep; a tool's schema may nest at most "
            f"{MAX_TOOL_SCHEMA_DEPTH} levels"
        )
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except RecursionError:  # a deep stack already: refused, not a 500
        raise ValueError("too deeply nested to check") from None
    except jsonschema.SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path)
        raise ValueError(
            f"not a valid JSON Schema: {error.message}" + (f" (at {where})" if where else "")
        ) from None


def _nesting_depth(value: Any) -> int:
    """How deep arrays and objects nest in `value` (without recursion)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in children)
    return deepest


def check_tool_request(tools: list[ChatTool] | None, tool_choice: ToolChoice | None) -> None:
    """Checks across fields (a 400 naming the field): a named or required choice needs
    the tools it names."""
    names = {tool.function.name for tool in tools or []}
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise SamplingParamError(
            "tool_choice",
            f"names the function {tool_choice.function.name!r}, which is not in tools "
            f"({', '.join(sorted(names)) or 'none given'})",
        )
    if tool_choice == "required" and not names:
        raise SamplingParamError("tool_choice", '"required" needs at least one tool')


def tool_constraint(
    tools: list[ChatTool] | None, tool_choice: ToolChoice | None, parallel: bool = True
) -> dict | None:
    """The JSON schema the output must follow for `tool_choice`, or None (free output)."""
    if isinstance(tool_choice, NamedToolChoice):
        return next(
            t.function.arguments_schema
            for t in tools or []
            if t.function.name == tool_choice.function.name
        )
    if tool_choice != "required":
        return None
    calls = [
        {
            "type": "object",
            # name first: the parser reads the name before the arguments stream.
            "properties": {
                "name": {"const": t.function.name},
                "parameters": t.function.arguments_schema,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools or []
    ]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_call_parser(tool_choice: ToolChoice | None) -> ToolParser | None:
    """How to read the output that `tool_constraint` forced, or None."""
    if isinstance(tool_choice, NamedToolChoice):
        return NamedCallParser(tool_choice.function.name)
    if tool_choice == "required":
        return RequiredCallsParser()
    return None


class NamedCallParser(ToolParser):
    """The whole output is the named function's arguments object."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        start = skip_whitespace(text, 0)
        end = json_value_end(text, start)
        return Scan("", [ToolCall(self.function, text[start : end or len(text)], end is not None)])


class RequiredCallsParser(ToolParser):
    """The output is `[{"name": ..., "parameters": {...}}, ...]`."""

    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        scan = Scan()
        position = skip_whitespace(text, 0)
        if not text.startswith("[", position):
            return scan
        position += 1
        while True:
            position = skip_whitespace(text, position)
            if not text.startswith("{", position):
                return scan  # "]", or the next call still arriving
            found = read_call_object(text, position)
            if found.call is None:
                return scan
            scan.calls.append(found.call)
            if found.end is None:
                return scan
            position = skip_whitespace(text, found.end)
            if text.startswith(",", position):
                position += 1


def template_messages(messages: list, template: str | None) -> list[dict]:
    """Chat messages (openai_protocol.ChatMessage) as chat templates expect them: plain
    strings; `developer` is OpenAI's newer name for `system`, which is the role templates
    know. An assistant's calls go as `tool_calls`, or as JSON text in its content when
    `template` never reads tool_calls."""
    knows_calls = not isinstance(template, str) or "tool_calls" in template
    rendered = []
    for m in messages:
        message: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        if m.tool_calls and knows_calls:
            message["tool_calls"] = template_tool_calls(m.tool_calls)
        elif m.tool_calls:
            message["content"] = "\n".join(filter(None, [m.text, calls_as_text(m.tool_calls)]))
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        rendered.append(message)
    return rendered


def template_tool_calls(calls: list[MessageToolCall]) -> list[dict]:
    """An assistant message's calls as chat templates read them: arguments as an object
    (templates write them with `tojson`) when they are JSON."""
    rendered = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.function.arguments)
        except ValueError:
            arguments = call.function.arguments
        rendered.append(
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": arguments},
            }
        )
    return rendered


def calls_as_text(calls: list[MessageToolCall]) -> str:
    """For a template that knows no tool calls: the calls as JSON text in the message, so
    the model still sees what it called."""
    return json.dumps(
        [{"name": c.function.name, "arguments": c.function.arguments} for c in calls],
        ensure_ascii=False,
    )

"""What every tool-call parser shares: the scan result, JSON reading helpers, OpenAI's shape.

A parser reads the text a model generated and splits it into content (text for the
user) and tool calls. It is written as one function, `scan(text, final)`, that reads the
whole text so far; the same function serves a whole answer (`final=True`) and a stream
(called on each longer prefix; chat_output.py sends what grew since the last call). For
that, a scan of a prefix must never contradict a scan of the whole:

- `content` only grows: text that may still turn out to start a call (a partial marker
  such as "<tool_ca", an unfinished call) is held back until it is decided;
- a call appears once its name is known, and its `arguments` text only grows.

A call whose name cannot be read (malformed output) is left in the content as text.
Arguments are the JSON text exactly as the model wrote it, so streamed pieces add up to
the final string.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    """One call found in the output: the function's name and its arguments (JSON text,
    possibly unfinished while streaming or when the output was cut by max_tokens)."""

    name: str
    arguments: str = ""
    complete: bool = False  # the arguments value is closed


@dataclass
class Scan:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser:
    """One output format. Subclasses set `name` and implement `scan`."""

    name: str = ""

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def parse(self, text: str) -> Scan:
        """The whole output: content and calls."""
        return self.scan(text, final=True)


def openai_tool_calls(calls: list[ToolCall], ids: list[str] | None = None) -> list[dict]:
    """Calls in OpenAI's message shape: {"id", "type": "function", "function": {...}}."""
    ids = ids or [new_call_id() for _ in calls]
    return [
        {
            "id": call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call_id, call in zip(ids, calls, strict=True)
    ]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- reading JSON as it arrives ------------------------------------------------------------
_WHITESPACE = re.compile(r"\s*")
_SCALAR = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


def skip_whitespace(text: str, position: int) -> int:
    return _WHITESPACE.match(text, position).end()


def json_value_end(text: str, start: int) -> int | None:
    """The end of the JSON value that starts at `start` (no leading whitespace), or None
    while it is unfinished. Only the structure is read (brackets, strings); whether the
    value is valid JSON is for json.loads to say."""
    if start >= len(text):
        return None
    opening = text[start]
    if opening in "{[":
        depth, position, in_string = 0, start, False
        while position < len(text):
            char = text[position]
            if in_string:
                if char == "\\":
                    position += 1
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return position + 1
            position += 1
        return None
    if opening == '"':
        position = start + 1
        while position < len(text):
            if text[position] == "\\":
                position += 2
                continue
            if text[position] == '"':
                return position + 1
            position += 1
        return None
    match = _SCALAR.match(text, start)
    # A number may go on ("12" then "3"): finished only once something follows it.
    if match is None or match.end() == len(text):
        return None
    return match.end()


# {"name": "...", "arguments": <value>} with the name first, as every template writes it.
_CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_CALL_HEAD_MAX = 512  # characters before the arguments: past this, it is not a call


@dataclass
class CallObject:
    """A `{"name": ..., "arguments": ...}` object read from `start`."""

    call: ToolCall | None  # None: not (yet) readable as a call
    end: int | None  # after the object's closing brace; None while unfinished
    malformed: bool = False


def read_call_object(text: str, start: int) -> CallObject:
    """Read a call object at `start` (a "{"). Malformed: its head cannot be a call's."""
    head = _CALL_HEAD.match(text, start)
    object_end = json_value_end(text, start)
    if head is None:
        decided = object_end is not None or len(text) - start > _CALL_HEAD_MAX
        return CallObject(None, object_end, malformed=decided)
    name = json.loads(f'"{head.group(1)}"')
    arguments_start = head.end()
    arguments_end = json_value_end(text, arguments_start)
    arguments = text[arguments_start : arguments_end or len(text)]
    return CallObject(ToolCall(name, arguments, arguments_end is not None), object_end)


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of `text` may be the start of one of `markers`."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest

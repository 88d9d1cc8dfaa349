"""DeepSeek's tool-call formats.

V3 / R1 (`deepseek_v3`), special tokens around each call and a fenced JSON body::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 drops the type and the fence (`<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{...}`);
the same parser reads both.

V3.2 and V4 (`deepseek_v4`) write DSML markup, one parameter per element; a parameter
with `string="true"` holds raw text, `string="false"` holds JSON::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

(V3.2 wraps the calls in `function_calls` instead of `tool_calls`; ASCII `|` is accepted
in place of `｜`.) The arguments of a DSML call are built as a JSON object, one member
per finished parameter.
"""

from __future__ import annotations

import json
import re

from atom.entrypoints.tool_parsers.base import (
    Scan,
    ToolCall,
    ToolParser,
    held_back,
    json_value_end,
    skip_whitespace,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"

    def scan(self, text: str, final: bool) -> Scan:
        begin = text.find(CALLS_BEGIN)
        if begin < 0:
            hold = 0 if final else held_back(text, (CALLS_BEGIN, CALL_BEGIN))
            return Scan(text[: len(text) - hold])
        scan = Scan(text[:begin])
        position = begin + len(CALLS_BEGIN)
        while True:
            position = skip_whitespace(text, position)
            rest = text[position:]
            if rest.startswith(CALLS_END):
                scan.content += rest[len(CALLS_END) :]
                return scan
            if not rest.startswith(CALL_BEGIN):
                if final:
                    scan.content += rest  # malformed (or cut): kept as text
                return scan
            call, next_position = self._call(text, position + len(CALL_BEGIN))
            if call is None:  # no name (yet)
                if final:
                    scan.content += rest
                return scan
            position = next_position
            scan.calls.append(call)
            if position is None:
                return scan

    @staticmethod
    def _call(text: str, start: int) -> tuple[ToolCall | None, int | None]:
        """(the call read from `start`, where the next one may begin or None)."""
        sep = text.find(SEP, start)
        if sep < 0:
            return None, start
        kind, after_sep = text[start:sep], sep + len(SEP)
        if kind.strip() == "function" and not text.startswith(
            "{", skip_whitespace(text, after_sep)
        ):
            newline = text.find("\n", after_sep)
            if newline < 0:
                return None, start  # the name is still arriving
            name = text[after_sep:newline].strip()
            arguments_start = skip_whitespace(text, newline + 1)
            if text.startswith(FENCE_OPEN, arguments_start):
                arguments_start = skip_whitespace(text, arguments_start + len(FENCE_OPEN))
            elif FENCE_OPEN.startswith(text[arguments_start:]):
                return ToolCall(name), None  # the fence is still arriving
        else:
            name, arguments_start = kind.strip(), skip_whitespace(text, after_sep)
        if not name:
            return None, start
        end = json_value_end(text, arguments_start)
        call = ToolCall(name, text[arguments_start : end or len(text)], end is not None)
        if end is None:
            return call, None
        after = skip_whitespace(text, end)
        if text.startswith(FENCE_CLOSE, after):
            after = skip_whitespace(text, after + len(FENCE_CLOSE))
        if text.startswith(CALL_END, after):
            return call, after + len(CALL_END)
        close = text.find(CALL_END, after)
        return call, (close + len(CALL_END) if close >= 0 else None)


_BAR = "[|｜]"
_DSML_BEGIN = re.compile(f"<{_BAR}DSML{_BAR}(?:tool_calls|function_calls)>")
_DSML_END = re.compile(f"</{_BAR}DSML{_BAR}(?:tool_calls|function_calls)>")
_INVOKE = re.compile(f'<{_BAR}DSML{_BAR}invoke\\s+name="([^"]*)"\\s*>')
_INVOKE_END = re.compile(f"</{_BAR}DSML{_BAR}invoke>")
_PARAMETER = re.compile(
    f'<{_BAR}DSML{_BAR}parameter\\s+name="([^"]*)"(?:\\s+string="(true|false)")?\\s*>'
    f"(.*?)</{_BAR}DSML{_BAR}parameter>",
    re.DOTALL,
)
_DSML_MARKERS = tuple(
    f"<{bar}DSML{bar}{kind}>" for bar in "|｜" for kind in ("tool_calls", "function_calls")
)


class DeepSeekV4ToolParser(ToolParser):
    name = "deepseek_v4"

    def scan(self, text: str, final: bool) -> Scan:
        begin = _DSML_BEGIN.search(text)
        if begin is None:
            hold = 0 if final else held_back(text, _DSML_MARKERS)
            return Scan(text[: len(text) - hold])
        scan = Scan(text[: begin.start()])
        position = begin.end()
        while True:
            position = skip_whitespace(text, position)
            end = _DSML_END.match(text, position)
            if end is not None:
                scan.content += text[end.end() :]
                return scan
            invoke = _INVOKE.match(text, position)
            if invoke is None:
                if final:
                    scan.content += text[position:]  # malformed (or cut): kept as text
                return scan
            call = ToolCall(invoke.group(1))
            members: list[str] = []
            position = invoke.end()
            while True:
                position = skip_whitespace(text, position)
                parameter = _PARAMETER.match(text, position)
                if parameter is None:
                    break
                members.append(f"{json.dumps(parameter.group(1))}: {_json_value(parameter)}")
                position = parameter.end()
            call.arguments = "{" + ", ".join(members)
            closed = _INVOKE_END.match(text, position)
            if closed is not None:
                call.arguments += "}"
                call.complete = True
            scan.calls.append(call)
            if closed is None:
                return scan
            position = closed.end()


def _json_value(parameter: re.Match) -> str:
    """A DSML parameter's value as JSON text: raw text is a JSON string; `string="false"`
    text is JSON already (kept as a string when it is not)."""
    value = parameter.group(3)
    if parameter.group(2) == "false":
        try:
            json.loads(value)
            return value.strip()
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)

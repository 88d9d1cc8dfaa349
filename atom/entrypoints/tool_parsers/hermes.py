"""Hermes / Qwen2.5 / Qwen3: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Qwen2.5's template writes `<tool_call>\n{json}\n</tool_call>` per call; several calls
follow one another, with text before them as the message's content.
"""

from __future__ import annotations

from atom.entrypoints.tool_parsers.base import (
    Scan,
    ToolParser,
    held_back,
    read_call_object,
    skip_whitespace,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        scan = Scan()
        position = 0
        while True:
            begin = text.find(START, position)
            if begin < 0:
                tail = text[position:]
                scan.content += tail if final else tail[: len(tail) - held_back(tail, (START,))]
                return scan
            scan.content += text[position:begin]
            body = skip_whitespace(text, begin + len(START))
            close = text.find(END, body)
            found = read_call_object(text, body) if text.startswith("{", body) else None
            if found is None or found.call is None:
                # Not a call (malformed): its text stays, from the tag to the end tag (or
                # to the end of the output). Until that is clear, it may still become one.
                malformed = body < len(text) if found is None else found.malformed
                if malformed and close >= 0:
                    scan.content += text[begin : close + len(END)]
                    position = close + len(END)
                    continue
                if final:
                    scan.content += text[begin:]
                return scan
            scan.calls.append(found.call)
            if found.end is None:
                return scan  # arguments (or the object) still arriving
            after = skip_whitespace(text, found.end)
            if text.startswith(END, after):
                position = after + len(END)
            elif close >= 0:  # text between the object and its end tag: dropped
                position = close + len(END)
            else:
                return scan  # the end tag has not arrived (or the output was cut)

"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole answer is
`{"name": ..., "parameters": {...}}` (several joined by `;`), optionally after
`<|python_tag|>` (a special token: usually removed by detokenization already).

An answer that does not start with `{` is content; one that starts with `{` but is not
a call object (e.g. JSON the user asked for) is content too, once that is clear.
"""

from __future__ import annotations

from atom.entrypoints.tool_parsers.base import (
    Scan,
    ToolParser,
    read_call_object,
    skip_whitespace,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> Scan:
        start = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_whitespace(text, start + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[start:]):
            return Scan()  # nothing yet, or the start of the tag
        if start == len(text):
            return Scan(text if final else "")
        if text[start] != "{":
            return Scan(text)  # a plain answer
        scan = Scan()
        position = start
        while True:
            found = read_call_object(text, position)
            if found.call is None:
                if found.malformed or final:
                    scan.content = text[position:] if scan.calls else text
                return scan
            scan.calls.append(found.call)
            if found.end is None:
                return scan
            after = skip_whitespace(text, found.end)
            if after == len(text):
                return scan  # a `;` and another call may follow
            if text[after] != ";":
                scan.content = text[after:]  # text after the calls
                return scan
            position = skip_whitespace(text, after + 1)
            if position == len(text):
                return scan
            if text[position] != "{":
                scan.content = text[position:]
                return scan

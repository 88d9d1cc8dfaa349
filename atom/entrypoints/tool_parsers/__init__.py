"""Tool-call parsers: one module per output format (base.py says what they share).

`--tool-call-parser NAME` picks one; without it, `detect_tool_parser` picks the one whose
markers the model's chat template writes, when exactly one does.
"""

from __future__ import annotations

from atom.entrypoints.tool_parsers.base import (
    Scan,
    ToolCall,
    ToolParser,
    new_call_id,
    openai_tool_calls,
)
from atom.entrypoints.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV4ToolParser
from atom.entrypoints.tool_parsers.hermes import HermesToolParser
from atom.entrypoints.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen2_5": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV3ToolParser,
    "deepseek_v32": DeepSeekV4ToolParser,
    "deepseek_v4": DeepSeekV4ToolParser,
}

# What a chat template writes when it teaches the model a format.
_TEMPLATE_MARKERS = {
    "hermes": ("<tool_call>",),
    "deepseek_v3": ("tool▁calls▁begin",),
    "deepseek_v4": ("DSML",),
    "llama3_json": ("<|python_tag|>",),
}


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}"
        ) from None


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser whose markers the template writes, if exactly one format's do."""
    if not isinstance(chat_template, str):
        return None
    found = [
        name
        for name, markers in _TEMPLATE_MARKERS.items()
        if any(marker in chat_template for marker in markers)
    ]
    return found[0] if len(found) == 1 else None


__all__ = [
    "TOOL_PARSERS",
    "Scan",
    "ToolCall",
    "ToolParser",
    "detect_tool_parser",
    "new_call_id",
    "openai_tool_calls",
    "tool_parser",
]

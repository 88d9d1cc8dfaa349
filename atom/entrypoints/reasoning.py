"""Reasoning output: `<think>...</think>` split off into `reasoning_content`.

DeepSeek-R1, V3.1+/V4 in thinking mode and Qwen3 write their reasoning between `<think>`
and `</think>`, then the answer. Some templates open `<think>` in the prompt (R1's
generation prompt ends with it), so the output starts inside the reasoning without the
tag: the caller says so (`starts_inside`, from the prompt's text). An output that never
opens `<think>` is all content; one cut before `</think>` is all reasoning.

`scan` follows the same rule as the tool parsers (tool_parsers/base.py): on a longer
prefix, neither part ever shrinks, so it serves whole answers and streams alike.
"""

from __future__ import annotations

from atom.entrypoints.tool_parsers.base import held_back, skip_whitespace

START, END = "<think>", "</think>"


class ThinkReasoningParser:
    def scan(self, text: str, final: bool, starts_inside: bool) -> tuple[str | None, str]:
        """(reasoning, or None when the output has none; content)."""
        body = 0
        if not starts_inside:
            start = skip_whitespace(text, 0)
            if text.startswith(START, start):
                body = start + len(START)
            elif not final and START.startswith(text[start:]):
                return None, ""  # nothing yet, or the start of the tag
            else:
                return None, text
        end = text.find(END, body)
        if end < 0:
            reasoning = text[body:]
            if not final:
                reasoning = reasoning[: len(reasoning) - held_back(reasoning, (END,))]
            return reasoning, ""
        return text[body:end], text[end + len(END) :].lstrip()


REASONING_PARSERS = {
    "deepseek_r1": ThinkReasoningParser,
    "deepseek_v3": ThinkReasoningParser,
    "deepseek_v4": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,
}


def reasoning_parser(name: str) -> ThinkReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of "
            f"{', '.join(sorted(REASONING_PARSERS))}"
        ) from None


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside `<think>` (the output then starts there)."""
    tail = prompt_text.rstrip()
    return tail.endswith(START)

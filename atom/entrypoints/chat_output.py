"""From a chat choice's generated text to OpenAI's message and stream deltas.

`ChatFormat` holds the server's choices (--tool-call-parser, --reasoning-parser) and
makes one `ChatOutput` per choice of a request. A ChatOutput splits the text into
reasoning (reasoning.py), content and tool calls (tool_parsers/, or the forced-call
parsers of chat_tools.py when tool_choice constrained the output):

- `message(text)`: the whole answer as a message: `content`, `tool_calls`,
  `reasoning_content`;
- `delta(text, final)`: in a stream, what the new text adds, in OpenAI's delta shape.
  A tool call's first delta carries its index, id, type and function name (arguments
  ""); later ones carry pieces of function.arguments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from atom.entrypoints.chat_tools import forced_call_parser
from atom.entrypoints.reasoning import ThinkReasoningParser, reasoning_parser
from atom.entrypoints.tool_parsers import (
    ToolCall,
    ToolParser,
    detect_tool_parser,
    new_call_id,
    openai_tool_calls,
    tool_parser,
)

logger = logging.getLogger(__name__)


class ChatFormat:
    """The server's output parsing: `tool_call_parser` None = picked from the chat
    template when exactly one format's markers are in it (else tool calls under
    tool_choice "auto" are not parsed and stay text)."""

    def __init__(
        self,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        reasoning: str | None = None,
    ):
        self.tool_call_parser = tool_call_parser or detect_tool_parser(chat_template)
        if self.tool_call_parser is not None:
            tool_parser(self.tool_call_parser)  # an unknown name fails at start-up
            if tool_call_parser is None:
                logger.info("tool calls: %s format (from the chat template)", self.tool_call_parser)
        self.reasoning = reasoning
        if reasoning is not None:
            reasoning_parser(reasoning)

    def output(self, request, opens_reasoning: bool) -> ChatOutput:
        """A ChatOutput for one choice of `request` (a ChatCompletionRequest).
        `opens_reasoning`: the prompt ends inside `<think>`."""
        parser = forced_call_parser(request.tool_choice)
        if parser is None and request.tools and request.tool_choice in (None, "auto"):
            if self.tool_call_parser is not None:
                parser = tool_parser(self.tool_call_parser)
        # A forced call's output is the call's JSON from its first token: no reasoning.
        forced = parser is not None and parser.name in ("named", "required")
        thinking = None
        if self.reasoning is not None and not forced:
            thinking = reasoning_parser(self.reasoning)
        return ChatOutput(
            parser,
            thinking,
            opens_reasoning,
            parallel_tool_calls=request.parallel_tool_calls is not False,
        )


@dataclass
class _SentCall:
    id: str
    arguments: int  # characters of arguments sent


@dataclass
class ChatOutput:
    tools: ToolParser | None = None
    reasoning: ThinkReasoningParser | None = None
    starts_in_reasoning: bool = False
    parallel_tool_calls: bool = True
    text: str = ""
    _sent_reasoning: int = 0
    _sent_content: int = 0
    _sent_calls: list[_SentCall] = field(default_factory=list)
    _called: bool = False

    def _split(self, text: str, final: bool) -> tuple[str | None, str, list[ToolCall]]:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.scan(text, final, self.starts_in_reasoning)
        calls: list[ToolCall] = []
        if self.tools is not None:
            scan = self.tools.scan(content, final)
            content, calls = scan.content, scan.calls
            if not self.parallel_tool_calls:
                calls = calls[:1]
        self._called = self._called or bool(calls)
        return reasoning, content, calls

    def message(self, text: str) -> dict:
        reasoning, content, calls = self._split(text, final=True)
        message: dict = {"role": "assistant", "content": content}
        if calls:
            # The text around calls is mostly the newlines between them.
            message["content"] = content.strip() or None
            message["tool_calls"] = openai_tool_calls(calls)
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        return message

    def delta(self, new_text: str, final: bool) -> dict:
        """What `new_text` adds to the message ({} when nothing can be sent yet)."""
        self.text += new_text
        if self.tools is None and self.reasoning is None:
            return {"content": new_text} if new_text else {}
        reasoning, content, calls = self._split(self.text, final)
        delta: dict = {}
        if reasoning is not None and len(reasoning) > self._sent_reasoning:
            delta["reasoning_content"] = reasoning[self._sent_reasoning :]
            self._sent_reasoning = len(reasoning)
        if len(content) > self._sent_content:
            delta["content"] = content[self._sent_content :]
            self._sent_content = len(content)
        pieces = []
        for index, call in enumerate(calls):
            if index == len(self._sent_calls):
                sent = _SentCall(new_call_id(), 0)
                self._sent_calls.append(sent)
                function = {"name": call.name, "arguments": ""}
                pieces.append(
                    {"index": index, "id": sent.id, "type": "function", "function": function}
                )
            sent = self._sent_calls[index]
            if len(call.arguments) > sent.arguments:
                piece = call.arguments[sent.arguments :]
                sent.arguments = len(call.arguments)
                if pieces and pieces[-1]["index"] == index:  # the first delta: in one
                    pieces[-1]["function"]["arguments"] = piece
                else:
                    pieces.append({"index": index, "function": {"arguments": piece}})
        if pieces:
            delta["tool_calls"] = pieces
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        """ "tool_calls" when the model stopped after calling tools."""
        return "tool_calls" if reason == "stop" and self._called else reason

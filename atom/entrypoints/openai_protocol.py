"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Types are strict (no "16" for 16, no 1 for true) and ranges follow OpenAI's API (vLLM's
extensions: top_k, min_tokens, repetition_penalty, stop_token_ids, ignore_eos). Unknown
top-level fields are ignored with one warning log line per request, as vLLM does
(clients such as LangChain send extra fields); known fields keep strict validation, and
a feature atom does not have (tools in /v1/completions, the deprecated `functions`) is
refused with a 400 that says so. Tools in chat: chat_tools.py. The fields every
generation request shares: sampling_request.py.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from atom.entrypoints.chat_tools import (
    ChatTool,
    MessageToolCall,
    ToolChoice,
    check_tool_request,
    template_messages,
    tool_constraint,
)
from atom.entrypoints.request_limits import current_limits
from atom.entrypoints.sampling_request import (
    MAX_N,
    SamplingRequest,
    UnicodeChecked,
    neutral_only,
    valid_unicode,
)
from atom.sampling_params import SamplingParamError, SamplingParams

logger = logging.getLogger(__name__)


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    # OpenAI's default; 0 only with echo (the prompt's log-probabilities, nothing generated)
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = 16
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    suffix: Any = None  # not implemented, as below
    # Tools are a chat feature (a completion has no template to describe them).
    tools: Any = None
    tool_choice: Any = None

    @field_validator("suffix", mode="before")
    @classmethod
    def _not_implemented_here(cls, value: Any) -> Any:
        return neutral_only(value, (None, 0, ""))

    @field_validator("tools", mode="before")
    @classmethod
    def _no_tools(cls, value: Any) -> Any:
        if value not in (None, []):
            raise ValueError("tools are for /v1/chat/completions; leave them out here")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none"):
            raise ValueError('tools are for /v1/chat/completions; leave it out or use "none"')
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be >= 1 (0 only with echo)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of: must equal n ({self.n}); atom returns every sample it generates"
            )
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        _within_limits(value)  # first: a list of millions is refused by its length alone

        def token_list(item: Any) -> bool:
            return isinstance(item, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in item
            )

        valid = (
            isinstance(value, str)
            or (isinstance(value, list) and all(isinstance(p, str) for p in value))
            or token_list(value)
            or (isinstance(value, list) and all(token_list(p) for p in value))
        )
        if not valid:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids "
                "or a list of token-id lists"
            )
        if not value or (
            isinstance(value, list) and any(not p for p in value if not isinstance(p, int))
        ):
            raise ValueError("must not be empty")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """max_tokens as the client gave it (None: the rest of the context)."""
        return self.max_tokens

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (a string or token ids each)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        return list(prompt)


def _within_limits(prompt: Any) -> None:
    """The server's cap on a prompt list's length (request_limits.py), checked before
    its members are."""
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):
        return  # a string or one prompt of token ids: max_model_len bounds it
    limit = current_limits().max_prompts_per_request
    if len(prompt) > limit:
        raise ValueError(
            f"{len(prompt)} prompts; this server takes at most {limit} per request "
            f"(--max-prompts-per-request)"
        )


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(UnicodeChecked):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None  # None: an assistant's tool calls only
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: StrictStr | None = None  # a tool message: the call it answers
    reasoning_content: StrictStr | None = None  # sent back by clients; templates drop it

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if value is None:
            return value
        # One clear message instead of pydantic's error per member of the union.
        parts_ok = isinstance(value, list) and all(
            isinstance(p, dict) and p.get("type") == "text" for p in value
        )
        if not isinstance(value, str) and not parts_ok:
            raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts')
        return valid_unicode(value)  # here: one error, not one per union member

    @model_validator(mode="after")
    def _fields_of_role(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message needs the id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries tool calls")
        if self.content is None and not self.tool_calls:
            raise ValueError("content: required (only an assistant's tool calls may go without)")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


_TEMPLATE_ARGUMENTS = {
    "messages",
    "conversation",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "return_dict",
    "chat_template",
}


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # None: up to max_model_len; max_completion_tokens is OpenAI's newer name
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: StrictBool | None = None  # None: true
    # vLLM's extensions: template variables (e.g. enable_thinking), and how the prompt ends
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "continue_final_message: continues the last message, so it needs "
                "add_generation_prompt set to false"
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict | None) -> dict | None:
        taken = sorted(set(value or {}) & _TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the server; send them as fields")
        return value

    def template_messages(self, template: str | None = None) -> list[dict]:
        """Messages as chat templates expect them (chat_tools.template_messages)."""
        return template_messages(self.messages, template)

    def template_options(self) -> dict:
        """The chat template's arguments besides the messages."""
        options = dict(self.chat_template_kwargs or {})
        if self.tools:
            options["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        options["add_generation_prompt"] = self.add_generation_prompt
        options["continue_final_message"] = self.continue_final_message
        return options

    def sampling_params(self, max_tokens: int, **options) -> SamplingParams:
        # A forced call's JSON without free whitespace (sampling_params.compact_json).
        return super().sampling_params(max_tokens, compact_json=self.structured_by_tools, **options)

    @property
    def structured_by_tools(self) -> bool:
        """Whether tool_choice constrains the output (required, or a named function)."""
        return bool(self.tools) and self.tool_choice not in (None, "auto", "none")

    def structured_schema(self) -> dict | None:
        """response_format's schema, or the one tool_choice imposes (chat_tools.py)."""
        check_tool_request(self.tools, self.tool_choice)
        constraint = tool_constraint(
            self.tools, self.tool_choice, self.parallel_tool_calls is not False
        )
        if constraint is None:
            return super().structured_schema()
        if self.response_format is not None and self.response_format.type != "text":
            raise SamplingParamError(
                "response_format", "cannot be combined with a required or named tool_choice"
            )
        return constraint

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

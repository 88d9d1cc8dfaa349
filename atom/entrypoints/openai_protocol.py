"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Types are strict (no "16" for 16, no 1 for true) and ranges follow OpenAI's API (vLLM's
extensions: top_k, min_tokens, repetition_penalty, stop_token_ids, ignore_eos). Unknown
top-level fields are ignored with one warning log line per request, as vLLM does
(clients such as LangChain send extra fields); known fields keep strict validation, and
a feature atom does not have (tools in /v1/completions, the deprecated `functions`) is
refused with a 400 that says so. Tools in chat: chat_tools.py.
"""

from __future__ import annotations

import logging
import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from atom.entrypoints.chat_tools import (
    ChatTool,
    MessageToolCall,
    ToolChoice,
    calls_as_text,
    check_tool_request,
    template_tool_calls,
    tool_constraint,
)
from atom.sampling_params import SamplingParamError, SamplingParams

logger = logging.getLogger(__name__)

_MAX_SEED = 2**63 - 1
MAX_N = 128  # samples per prompt


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object or json_schema (xgrammar enforces it)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.json_schema is None
        ):
            raise ValueError('type "json_schema" needs json_schema.schema')
        return self


def _number(value: Any) -> Any:
    # pydantic's lax float accepts "0.5" and true; OpenAI's API does not.
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError("must be a number")
    return value


def _neutral_only(value: Any, neutral: tuple = (None, 0, {})) -> Any:
    """For a parameter atom does not implement: accept only its no-op value."""
    if value not in neutral:
        raise ValueError("not supported by atom; leave it out")
    return value


def _valid_unicode(value: Any) -> Any:
    """`value`, unless it (a string, or lists, dicts and models of them) holds a lone UTF-16
    surrogate, which JSON's `\\ud800` escapes allow but no tokenizer can encode."""
    found = _lone_surrogate(value)
    if found is not None:
        raise ValueError(f"not valid Unicode text: a lone surrogate {found}")
    return value


def _lone_surrogate(value: Any) -> str | None:
    """Where the first lone surrogate is (e.g. "U+D800 at character 4 of [1]"), or None."""
    found = _find_lone_surrogate(value)
    if found is None:
        return None
    keys, position = found
    path = "".join(f"[{key!r}]" for key in reversed(keys))
    return f"{position} of {path}" if path else position


def _find_lone_surrogate(value: Any) -> tuple[list, str] | None:
    """(keys from the innermost out, position) of the first lone surrogate, or None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            return [], f"U+{ord(value[error.start]):04X} at character {error.start}"
        return None
    if isinstance(value, BaseModel):
        value = vars(value)
    if isinstance(value, dict):
        items = [*value.items(), *((key, key) for key in value)]
    elif isinstance(value, (list, tuple)):
        if set(map(type, value)) <= {int, float, bool}:  # e.g. token ids: no text, skip fast
            return None
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _find_lone_surrogate(item)
        if found is not None:
            found[0].append(key)
            return found
    return None


class _UnicodeChecked(BaseModel):
    """Refuses text that is not valid Unicode (a 400 naming the field, not a tokenizer
    crash); nested models check their own fields first, so the error names the deepest."""

    @field_validator("*")
    @classmethod
    def _unicode_text(cls, value: Any) -> Any:
        return _valid_unicode(value)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class SamplingRequest(_UnicodeChecked):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None  # None: the served model
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    # vLLM's extension: -1 or 0 disables (the bound keeps it an int32 for the sampler)
    top_k: Annotated[StrictInt, Field(le=2**31 - 1)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=_MAX_SEED)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    ignore_eos: StrictBool = False  # vLLM's extension: generate past end-of-sequence
    user: StrictStr | None = None  # accepted and ignored, as OpenAI's API only logs it
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias, clamped to +-100
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0  # vLLM's extension
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None  # vLLM's extension
    response_format: ResponseFormat | None = None
    functions: Any = None  # OpenAI's deprecated form of tools: refused

    @field_validator(
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        mode="before",
    )
    @classmethod
    def _strict_number(cls, value: Any) -> Any:
        return _number(value)

    @field_validator("functions", mode="before")
    @classmethod
    def _no_functions(cls, value: Any) -> Any:
        if value not in (None, []):
            raise ValueError('deprecated by OpenAI and not supported; send "tools" instead')
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and k.strip().isdigit() for k in value
        ):
            raise ValueError("must map token ids (as strings) to numbers")
        for bias in value.values():
            _number(bias)
            if isinstance(bias, float) and not math.isfinite(bias):  # NaN: no silent -100
                raise ValueError(f"biases must be finite numbers, got {bias}")
        return value

    @model_validator(mode="after")
    def _warn_unknown_fields(self):
        if self.model_extra:
            logger.warning(
                "ignored unknown request fields: %s", ", ".join(sorted(self.model_extra))
            )
        return self

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError("must be -1 or 0 (disabled) or a positive integer")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else value
        if value is not None and (
            not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
        ):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")  # as OpenAI and vLLM
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, **options) -> SamplingParams:
        """Raises ValueError (a 400) for values SamplingParams refuses. `options`: the
        endpoint's own SamplingParams fields (logprobs, prompt_logprobs, best_of)."""
        response_format = self.response_format
        requested = self.requested_max_tokens
        if requested is not None and self.min_tokens > requested:  # refused, as vLLM does
            raise SamplingParamError(
                "min_tokens", f"must be at most max_tokens ({requested}), got {self.min_tokens}"
            )
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            n=self.n,
            # max_tokens left out: all the context leaves, which may be less than min_tokens
            min_tokens=min(self.min_tokens, max_tokens),
            stop_token_ids=list(self.stop_token_ids or []),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias={
                int(token): min(100.0, max(-100.0, float(bias)))
                for token, bias in (self.logit_bias or {}).items()
            }
            or None,
            json_object=response_format is not None and response_format.type == "json_object",
            json_schema=self.structured_schema(),
            **options,
        )

    def structured_schema(self) -> dict | None:
        """The JSON schema the output must follow, or None."""
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_schema":
            return response_format.json_schema.json_schema
        return None


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
        return _neutral_only(value, (None, 0, ""))

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


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_UnicodeChecked):
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
        return _valid_unicode(value)  # here: one error, not one per union member

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
        """Messages as chat templates expect them: plain strings; `developer` is OpenAI's
        newer name for `system`, which is the role templates know. An assistant's calls go
        as `tool_calls`, or as JSON text when `template` never reads tool_calls."""
        knows_calls = not isinstance(template, str) or "tool_calls" in template
        rendered = []
        for m in self.messages:
            message: dict = {"role": "system" if m.role == "developer" else m.role}
            message["content"] = m.text
            if m.tool_calls and knows_calls:
                message["tool_calls"] = template_tool_calls(m.tool_calls)
            elif m.tool_calls:
                message["content"] = "\n".join(filter(None, [m.text, calls_as_text(m.tool_calls)]))
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            rendered.append(message)
        return rendered

    def template_options(self) -> dict:
        """The chat template's arguments besides the messages."""
        options = dict(self.chat_template_kwargs or {})
        if self.tools:
            options["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        options["add_generation_prompt"] = self.add_generation_prompt
        options["continue_final_message"] = self.continue_final_message
        return options

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

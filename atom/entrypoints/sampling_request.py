"""What every generation request carries, validated by pydantic: the sampling fields
(`SamplingRequest`, the base of the completion and chat requests in openai_protocol.py),
response formats, stream options, and the checks of strings (valid Unicode, no lone
surrogates) that the other APIs' request bodies share.

Types are strict (no "16" for 16, no 1 for true) and ranges follow OpenAI's API (vLLM's
extensions: top_k, min_tokens, repetition_penalty, stop_token_ids, ignore_eos).
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


def neutral_only(value: Any, neutral: tuple = (None, 0, {})) -> Any:
    """For a parameter atom does not implement: accept only its no-op value."""
    if value not in neutral:
        raise ValueError("not supported by atom; leave it out")
    return value


def valid_unicode(value: Any) -> Any:
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


class UnicodeChecked(BaseModel):
    """Refuses text that is not valid Unicode (a 400 naming the field, not a tokenizer
    crash); nested models check their own fields first, so the error names the deepest."""

    @field_validator("*")
    @classmethod
    def _unicode_text(cls, value: Any) -> Any:
        return valid_unicode(value)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class SamplingRequest(UnicodeChecked):
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

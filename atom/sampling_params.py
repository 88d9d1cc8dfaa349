"""Per-request sampling parameters.

Validation happens here, at construction, so a bad request is refused before it
reaches the scheduler (no blocks are ever allocated for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

_MAX_SEED = 2**63 - 1
# Below this a temperature means greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-38
# overflows them to inf and the softmax to NaN.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs


class SamplingParamError(ValueError):
    """A sampling value is refused; `param` names the request field (the server's 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def check_token_ids(param: str, token_ids, vocab_size: int) -> None:
    """Raise SamplingParamError unless every id of `token_ids` is in [0, vocab_size)."""
    for token_id in token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise SamplingParamError(param, f"token ids must be integers, got {token_id!r}")
        if not 0 <= token_id < vocab_size:
            raise SamplingParamError(
                param,
                f"token ids must be in the model's vocabulary [0, {vocab_size}); "
                f"token id {token_id} is not",
            )


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop.

    temperature: 0 (or anything below GREEDY_TEMPERATURE) means greedy; at most 100.
    top_k: -1 (or 0) disables; otherwise >= 1.
    top_p: in (0, 1]; 1 disables.
    max_tokens: number of tokens to generate, >= 1.
    ignore_eos: keep generating past the end-of-sequence token.
    stop_token_ids: extra token ids that end generation (the token is kept in the output).
    seed: makes random sampling of this request reproducible, whatever its batch.

    OpenAI / vLLM options (atom/model_engine/sampling/logits_processors.py applies them, as vLLM
    defines them):
    n: samples of the prompt (they share its KV blocks through the prefix cache; sample i
        of a seeded request uses seed + i).
    best_of: accepted only equal to n (atom returns every sample).
    min_tokens: end-of-sequence and stop_token_ids are masked until this many tokens.
    presence_penalty, frequency_penalty: in [-2, 2], subtracted per generated occurrence.
    repetition_penalty: > 0; 1 disables; divides positive logits (multiplies negative
        ones) of tokens seen in the prompt or the output.
    logit_bias: {token id: bias}, added to the logits (bias in [-100, 100]).
    logprobs: None = off; k >= 0 = the sampled token's log-probability plus the top k.
    prompt_logprobs: None = off; k >= 0 = the same for every prompt token (echo).
    json_schema / json_object: constrain the output to JSON (xgrammar token bitmask).
    compact_json: with json_schema, no whitespace between JSON tokens (the server's forced
        tool calls: a model cannot stall writing whitespace until max_tokens).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    best_of: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: dict | str | None = None
    json_object: bool = False
    compact_json: bool = False
    # Set by the engine when it admits the request: stop_token_ids plus its
    # end-of-sequence ids (unless ignore_eos), the ids min_tokens masks.
    all_stop_token_ids: list[int] = field(default_factory=list, repr=False, compare=False)
    # Set by the server once it has compiled json_schema / json_object on its grammar pool
    # (within the compile timeout): the engine takes this grammar as it is, so its thread
    # never compiles one (xgrammar's cache may have evicted the schema meanwhile).
    compiled_grammar: object = field(default=None, repr=False, compare=False)
    # Derived: some option above needs the runner's SamplingPlan (sampling/plan.py).
    needs_sampling_plan: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(
                f"temperature must be in [0, 100] (0 = greedy), got {self.temperature}"
            )
        self.temperature = float(self.temperature)
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer (-1 disables), got {self.top_k!r}")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1 or self.top_k > 2**31 - 1:
            raise ValueError(f"top_k must be -1 (disabled) or in [1, 2**31 - 1], got {self.top_k}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_p = float(self.top_p)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = list(self.stop_token_ids)
        if not self.all_stop_token_ids:
            self.all_stop_token_ids = list(self.stop_token_ids)
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed <= _MAX_SEED
        ):
            raise ValueError(
                f"seed must be an integer in [0, 2**63 - 1] or None, got {self.seed!r}"
            )
        self._check_openai_options()

    def _check_openai_options(self) -> None:
        def integer(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def number(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        if not integer(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not integer(self.best_of) or self.best_of != self.n):
            raise ValueError(
                f"best_of must equal n ({self.n}) when given: atom returns every sample, "
                f"got {self.best_of!r}"
            )
        if not integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
            setattr(self, name, float(value))
        if not number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(
                f"repetition_penalty must be a number in (0, 100] (1 disables), "
                f"got {self.repetition_penalty!r}"
            )
        self.repetition_penalty = float(self.repetition_penalty)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                integer(t) and t >= 0 and number(b) and -100.0 <= b <= 100.0
                for t, b in self.logit_bias.items()
            ):
                raise ValueError(
                    "logit_bias must map token ids (integers >= 0) to biases in [-100, 100], "
                    f"got {self.logit_bias!r}"
                )
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()} or None
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not integer(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str)):
            raise ValueError("json_schema must be a JSON schema (a dict or its JSON text)")
        if not isinstance(self.compact_json, bool):
            raise ValueError(f"compact_json must be true or false, got {self.compact_json!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be true or false, got {self.json_object!r}")
        self.needs_sampling_plan = (
            self.processes_logits
            or self.logprobs is not None
            or self.prompt_logprobs is not None
            or self.structured
        )

    def check_token_ids(self, vocab_size: int) -> None:
        """Every token id the request carries (stop_token_ids, logit_bias) must index the
        model's vocabulary: SamplingParamError naming the field otherwise."""
        check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        check_token_ids("logit_bias", self.logit_bias or (), vocab_size)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def processes_logits(self) -> bool:
        """Whether the logits need more than temperature / top-k / top-p before sampling."""
        return self.has_penalties or self.logit_bias is not None or self.min_tokens > 0

    @property
    def structured(self) -> bool:
        return self.json_object or self.json_schema is not None

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of an n > 1 request: n = 1, its own seed."""
        seed = None if self.seed is None else (self.seed + index) % (_MAX_SEED + 1)
        return replace(self, n=1, best_of=None, seed=seed)

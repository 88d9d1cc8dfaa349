"""Per-request sampling parameters.

Validation happens here, at construction, so a bad request is refused before it
reaches the scheduler (no blocks are ever allocated for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_SEED = 2**63 - 1
# Below this a temperature means greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-38
# overflows them to inf and the softmax to NaN.
GREEDY_TEMPERATURE = 1e-5


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
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

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
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed <= _MAX_SEED
        ):
            raise ValueError(
                f"seed must be an integer in [0, 2**63 - 1] or None, got {self.seed!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

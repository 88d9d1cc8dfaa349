"""Log-probabilities in OpenAI's two response shapes.

Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where
each `top_logprobs` entry maps token text to logprob for the chosen token plus the top k
(vLLM's order: the chosen token first), and the first prompt token of an echo has null.
Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
Log-probabilities below -9999 (a masked token: -inf) are reported as -9999, as vLLM does.
"""

from __future__ import annotations

from atom.model_engine.sampling.logprobs import Logprob

_FLOOR = -9999.0


class TokenTexts:
    """Text of single token ids, cached (the same ids recur across steps and requests)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        # Special tokens keep their text in `tokens`, but the response text skips them.
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", None) or ())

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = "" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


class CompletionLogprobs:
    """Accumulates one choice's completions-style logprobs (offsets run on)."""

    def __init__(self, texts: TokenTexts, k: int, offset: int = 0):
        self.texts = texts
        self.k = k
        self.offset = offset

    def body(self, token_ids: list[int], entries: list[Logprob | None]) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self.texts(token_id)
            tokens.append(text)
            offsets.append(self.offset)
            # offsets index the choice's text, which decodes without special tokens
            if token_id not in self.texts.special_ids:
                self.offset += len(text)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(_value(entry.logprob))
            top = {text: _value(entry.logprob)}
            for alternative, logprob in entry.top[: self.k]:
                top.setdefault(self.texts(alternative), _value(logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}  # fmt: skip


def chat_logprobs(texts: TokenTexts, k: int, entries: list[Logprob]) -> list[dict]:
    """The `content` list of a chat choice's logprobs."""

    def item(token_id: int, logprob: float) -> dict:
        text = texts(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}

    return [
        {
            **item(e.token_id, e.logprob),
            "top_logprobs": [item(t, lp) for t, lp in e.top[:k]],
        }
        for e in entries
    ]

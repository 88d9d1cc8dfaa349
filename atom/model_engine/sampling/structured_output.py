"""Structured output: JSON (any object, or one JSON schema) through xgrammar.

Each constrained request holds an xgrammar `GrammarMatcher` (`Sequence.grammar`). Before a
step samples, every constrained row fills its row of a token bitmask (32 tokens per int32
word, bit set = allowed); the bitmask goes to the device once and masks the logits of
all rows in one op (unconstrained rows are all ones), so constrained and unconstrained
requests share a batch. After the step, each matcher accepts its sampled token.

A matcher's next mask depends on the token just sampled, so a step with a constrained
request completes before the next one is scheduled (the engine turns asynchronous
scheduling off while such a request runs).
"""

from __future__ import annotations

import json

import numpy as np
import torch

from atom.model_engine.failures import RequestFailed, guard_each


class InvalidGrammarError(ValueError):
    """The json_schema of a request cannot be compiled (the server answers 400)."""


class GrammarBackend:
    """xgrammar over one tokenizer and vocabulary: compiles (cached) and makes matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, cache_limit_bytes: int = -1):
        """`cache_limit_bytes`: xgrammar's compiled-grammar cache evicts the least recently
        used past it (-1: unlimited; the engine passes ATOM_GRAMMAR_CACHE_MB)."""
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=1, cache_limit_bytes=cache_limit_bytes
        )

    def compile(self, params):
        """The compiled grammar of a request's json_schema / json_object."""
        try:
            if params.json_schema is not None:
                schema = params.json_schema
                text = schema if isinstance(schema, str) else json.dumps(schema)
                return self.compiler.compile_json_schema(
                    text, any_whitespace=not params.compact_json
                )
            return self.compiler.compile_builtin_json_grammar()
        except (RuntimeError, ValueError, TypeError) as error:
            raise InvalidGrammarError(f"invalid json_schema: {error}") from None

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)


def fill_bitmask(seqs: list, out: np.ndarray) -> None:
    """Fill `out` [S, ceil(V / 32)] int32 (a staged numpy view) with the allowed-token bits
    of the sampling rows; unconstrained rows allow everything. A matcher that raises fails
    its own request (RequestFailed), not the step's others."""
    out.fill(-1)
    bitmask = torch.from_numpy(out)

    def fill(seq, row: int) -> None:
        if not seq.grammar.is_terminated():
            seq.grammar.fill_next_token_bitmask(bitmask, row)

    constrained = [
        (s, row) for row, s in enumerate(seqs) if getattr(s, "grammar", None) is not None
    ]
    guard_each("the grammar matcher", constrained, fill)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set logits [S, V] to -inf where bit (token % 32) of word (token // 32) is 0."""
    rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(rows, -1)[:, :vocab].bool()
    return logits.masked_fill_(~allowed, float("-inf"))


def accept_tokens(seqs_and_tokens) -> tuple[list, RequestFailed | None]:
    """Advance each constrained sequence's matcher: (the sequences whose token it refused,
    RequestFailed naming those whose matcher raised, or None)."""
    refused = []

    def accept(seq, token: int) -> None:
        matcher = seq.grammar
        if matcher is not None and not matcher.is_terminated() and not matcher.accept_token(token):
            refused.append(seq)

    try:
        guard_each("the grammar matcher", seqs_and_tokens, accept)
    except RequestFailed as failure:
        return refused, failure
    return refused, None

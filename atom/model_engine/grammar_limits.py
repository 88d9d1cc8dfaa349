"""Bounds on what a json_schema may cost to compile, checked before xgrammar sees it.

xgrammar's compile time grows faster than linearly with a schema's repetition counts and
nesting: `{"type": "string", "pattern": "(a|b){20000}"}` (50 bytes) compiles for over a
minute, a 900-deep nested array schema about as long, and neither can be interrupted once
it runs. So a schema is measured first (size, depth, the largest count it asks for) and
refused with an error naming the keyword and the flag to change; a compile timeout
(atom/entrypoints/grammar_compile.py) is only the backstop.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from atom.model_engine.sampling.structured_output import InvalidGrammarError

# Keywords whose value is a count that xgrammar unrolls into that many grammar rules.
COUNT_KEYWORDS = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)


@dataclass(frozen=True)
class GrammarLimits:
    max_schema_bytes: int = 64 << 10
    max_schema_depth: int = 32
    max_repetition: int = 1000
    compile_timeout_s: float = 10.0
    compile_threads: int = 2

    def __post_init__(self) -> None:
        # The server's flags for each (atom/entrypoints/request_limits.py).
        flags = {
            "max_schema_bytes": "--max-schema-bytes",
            "max_schema_depth": "--max-schema-depth",
            "max_repetition": "--max-schema-repetition",
            "compile_threads": "--grammar-compile-threads",
        }
        for name, flag in flags.items():
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({flag}) must be at least 1, got {getattr(self, name)}")
        if not self.compile_timeout_s > 0:
            raise ValueError(
                f"compile_timeout_s (--grammar-compile-timeout) must be positive, "
                f"got {self.compile_timeout_s}"
            )


class GrammarLimitError(InvalidGrammarError):
    """A json_schema over one of the GrammarLimits (the server answers 400)."""


def check_schema(schema: Any, limits: GrammarLimits) -> None:
    """Raise GrammarLimitError if `schema` (a dict or JSON text) passes a limit."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_schema_bytes:
        raise GrammarLimitError(
            f"the json_schema is {size} bytes; this server compiles at most "
            f"{limits.max_schema_bytes} (--max-schema-bytes)"
        )
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return  # not JSON: xgrammar's own error says so
    _walk(schema, limits, "schema", 0)


def _walk(node: Any, limits: GrammarLimits, path: str, depth: int) -> None:
    # Iterative depth is what costs (each level is a rule xgrammar nests), so the bound is
    # on JSON nesting, which also keeps this walk's recursion short.
    if depth > limits.max_schema_depth:
        raise GrammarLimitError(
            f"the json_schema nests deeper than {limits.max_schema_depth} levels at {path} "
            f"(--max-schema-depth)"
        )
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}"
            if key in COUNT_KEYWORDS and isinstance(value, (int, float)):
                if value > limits.max_repetition:
                    raise GrammarLimitError(
                        f"{where} is {value}; this server allows counts up to "
                        f"{limits.max_repetition} (--max-schema-repetition)"
                    )
            elif key == "pattern" and isinstance(value, str):
                count = pattern_repetition(value)
                if count > limits.max_repetition:
                    raise GrammarLimitError(
                        f"{where} repeats up to {count} times; this server allows "
                        f"{limits.max_repetition} (--max-schema-repetition)"
                    )
            _walk(value, limits, where, depth + 1)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            _walk(value, limits, f"{path}[{index}]", depth + 1)


_QUANTIFIER = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")


def pattern_repetition(pattern: str) -> int:
    """The largest number of times one piece of `pattern` is unrolled: counted
    quantifiers ({n}, {n,}, {n,m}) multiplied through the groups they nest in
    ("((a){30}){30}" -> 900). `*`, `+` and `?` are loops, not unrolled: they count 1."""
    stack = [1]  # per open group: the largest count inside it so far
    index, length = 0, len(pattern)
    while index < length:
        char = pattern[index]
        index += 1
        if char == "\\":
            index += 1  # an escaped character is one atom
            inner = 1
        elif char == "[":  # a character class is one atom
            if index < length and pattern[index] == "^":
                index += 1
            if index < length and pattern[index] == "]":
                index += 1
            while index < length and pattern[index] != "]":
                index += 2 if pattern[index] == "\\" else 1
            index += 1
            inner = 1
        elif char == "(":
            stack.append(1)
            continue
        elif char == ")" and len(stack) > 1:
            inner = stack.pop()
        else:
            inner = 1
        match = _QUANTIFIER.match(pattern, index)
        count = 1
        if match and (match.group(1) or match.group(3)):
            low, comma, high = match.groups()
            # {n,} unrolls n copies then loops; {n,m} unrolls m.
            count = int(high) if comma and high else int(low or 0)
            index = match.end()
        stack[-1] = max(stack[-1], inner * max(count, 1))
    return max(stack)

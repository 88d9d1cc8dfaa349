"""The Proposer interface and the n-gram (prompt lookup) proposer.

A proposer guesses up to `limit` next tokens of a decoding sequence. The engine asks in two
steps, because the scheduler must reserve KV slots (and blocks) for the drafts before a
draft model can write its own KV into them:

1. `lookahead(seq, limit)` before scheduling: how many drafts the sequence will get
   (<= limit). The scheduler schedules 1 + that many tokens (fewer if the step's token
   budget runs out) and grows the sequence's blocks for them.
2. `propose(seqs, counts)` after scheduling: exactly `counts[i]` draft tokens for seqs[i].
3. `on_verified(seq, position, num_drafts, num_accepted)` after the verify step: the
   first new token sits at `position`; the first `num_accepted` drafts were kept.

`may_propose(seq)`: with asynchronous scheduling, whether `seq` (its last token still on
the device) could get drafts once that token is known; False lets the next step be
scheduled without waiting for it.

A proposer whose drafts come out of device work (the draft model) may also offer
`propose_on_device(seqs, counts)` for steps in which every sequence drafts the same
number d: it returns `DeviceDrafts` (nothing read back: the verify step takes them on the
device) or, when it had to read them anyway, the lists `propose` returns.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from atom.model_engine.sequence import Sequence


@dataclass
class DeviceDrafts:
    """Drafts still on the device: `tokens` [num_seqs * per_seq] int64, in batch order."""

    tokens: torch.Tensor
    per_seq: int


class Proposer(Protocol):
    def lookahead(self, seq: Sequence, limit: int) -> int: ...

    def propose(self, seqs: list[Sequence], counts: list[int]) -> list[list[int]]: ...

    def may_propose(self, seq: Sequence) -> bool: ...

    def on_verified(
        self, seq: Sequence, position: int, num_drafts: int, num_accepted: int
    ) -> None: ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (n from `max_n` down to `min_n`) and propose the tokens that followed it.

    Each sequence's tokens are mirrored in a numpy array owned by this proposer (appended
    incrementally: a sequence's tokens only grow while it speculates), so a lookup is a few
    vectorized comparisons over the context, not a Python scan.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n
        self._history: weakref.WeakKeyDictionary[Sequence, list] = weakref.WeakKeyDictionary()
        self._pending: dict[int, list[int]] = {}  # seq_id -> proposal of this step

    def _tokens(self, seq: Sequence) -> np.ndarray:
        """The known tokens of `seq` (a placeholder at the end is left out)."""
        entry = self._history.get(seq)
        n = len(seq.token_ids) - (seq.pending_token is not None)
        if entry is None or entry[1] > n:
            entry = [np.empty(max(2 * n, 64), np.int64), 0]
            self._history[seq] = entry
        array, known = entry
        if n > array.size:
            grown = np.empty(2 * n, np.int64)
            grown[:known] = array[:known]
            entry[0] = array = grown
        if n > known:
            array[known:n] = seq.token_ids[known:n]
            entry[1] = n
        return array[:n]

    def lookahead(self, seq: Sequence, limit: int) -> int:
        proposal = self.match(self._tokens(seq), limit)
        if proposal:
            self._pending[seq.seq_id] = proposal
        else:
            self._pending.pop(seq.seq_id, None)
        return len(proposal)

    def match(self, tokens: np.ndarray, limit: int) -> list[int]:
        """The continuation of the latest earlier match of the longest matching suffix."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # starts j <= length - n - 1 leave at least one token after the match
            starts = np.flatnonzero(tokens[: length - n] == suffix[0])
            for offset in range(1, n):
                if not starts.size:
                    break
                starts = starts[tokens[starts + offset] == suffix[offset]]
            if starts.size:
                begin = int(starts[-1]) + n
                return tokens[begin : begin + limit].tolist()
        return []

    def may_propose(self, seq: Sequence) -> bool:
        """Any next token t could complete a match only if the context's last
        `min_n - 1` tokens occur earlier (a match of n ending at t needs its first
        n - 1 tokens there); with min_n = 1 any t might match."""
        if self.min_n == 1:
            return True
        tokens = self._tokens(seq)
        length, n = len(tokens), self.min_n - 1
        if length <= n:
            return False
        suffix = tokens[length - n :]
        starts = np.flatnonzero(tokens[: length - n] == suffix[0])
        for offset in range(1, n):
            if not starts.size:
                break
            starts = starts[tokens[starts + offset] == suffix[offset]]
        return bool(starts.size)

    def propose(self, seqs: list[Sequence], counts: list[int]) -> list[list[int]]:
        pending, self._pending = self._pending, {}
        return [
            pending.get(s.seq_id, [])[:c] if c else [] for s, c in zip(seqs, counts, strict=True)
        ]

    def on_verified(self, seq: Sequence, position: int, num_drafts: int, num_accepted: int):
        pass

"""From a request's token stream to text deltas: incremental detokenization, stop strings.

Both OpenAI endpoints consume `text_deltas`, which turns a RequestStream (token ids per
step) into `TextDelta`s and stops the request in the engine when a stop string appears.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from atom.entrypoints.async_engine import AsyncEngine, RequestFailedError, RequestStream

_INCOMPLETE = "\ufffd"  # what a tokenizer decodes a partial UTF-8 sequence to


class IncrementalDetokenizer:
    """Text of a growing list of output token ids, decoded incrementally.

    Decoding everything again at every token costs O(n) per token. A fast tokenizer
    whose decode does no clean-up of spaces is streamed through `tokenizers`' own
    incremental decoder (`DecodeStream`: it holds back incomplete UTF-8 sequences and
    places spaces as a full decode does). Other tokenizers decode only the tokens since
    the previous emission plus one window of context, holding text back while it ends in
    an incomplete UTF-8 sequence. `finish` reconciles with one full decode, so the final
    text equals the offline `LLM.generate` text.

    Special tokens are left out of the text, except `keep_special` (ids): the markers a
    chat answer's tool-call or reasoning parser reads, when the tokenizer marks them
    special (chat_output.py). The others, end-of-sequence included, stay out.
    """

    def __init__(self, tokenizer, keep_special: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        # Skipped ids when some special tokens are kept (decoding then keeps all of them).
        self._hidden = _special_ids(tokenizer) - keep_special if keep_special else None
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._stream = None
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if self._backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):  # fmt: skip
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self._hidden is None)

    def _decode(self, token_ids: list[int]) -> str:
        if self._hidden is None:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)
        kept = [t for t in token_ids if t not in self._hidden]
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def add(self, token_ids: list[int]) -> None:
        start = len(self.token_ids)
        self.token_ids.extend(token_ids)
        if self.tokenizer is None:
            return
        if self._stream is not None:
            try:
                for token_id in token_ids:
                    if self._hidden is not None and token_id in self._hidden:
                        start += 1
                        continue
                    piece = self._stream.step(self._backend, token_id)
                    if piece:
                        self.text += piece
                    start += 1
                return
            except Exception:  # noqa: BLE001 - e.g. an id past the tokenizer's vocabulary
                self._stream = None  # the window decoder takes over from here
                self._prefix_offset = self._read_offset = start
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        window = self._decode(self.token_ids[self._prefix_offset :])
        if len(window) > len(prefix) and not window.endswith(_INCOMPLETE):
            self.text += window[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)

    def tokens_for(self, length: int) -> int:
        """The fewest leading output tokens whose text holds the first `length` characters
        (all of them without a tokenizer)."""
        if self.tokenizer is None or length <= 0:
            return 0 if self.tokenizer is not None else len(self.token_ids)
        low, high = 1, len(self.token_ids)  # binary search: a prefix's text only grows
        while low < high:
            middle = (low + high) // 2
            if len(self._decode(self.token_ids[:middle])) >= length:
                high = middle
            else:
                low = middle + 1
        return high

    def finish(self) -> None:
        if self.tokenizer is None:
            return
        full = self._decode(self.token_ids)
        if full.startswith(self.text):  # it always should; never take back text once sent
            self.text = full


def _special_ids(tokenizer) -> frozenset[int]:
    """Every id the tokenizer treats as special (`skip_special_tokens` leaves them out)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {i for i, token in added.items() if getattr(token, "special", False)}
    return frozenset(special | set(getattr(tokenizer, "all_special_ids", ())))


def special_marker_ids(tokenizer, markers) -> frozenset[int]:
    """The ids of `markers` (strings) that are single special tokens of `tokenizer`."""
    if tokenizer is None or not markers:
        return frozenset()
    special = _special_ids(tokenizer)
    ids = (tokenizer.convert_tokens_to_ids(marker) for marker in markers)
    return frozenset(i for i in ids if isinstance(i, int) and i in special)


class StopStrings:
    """Finds the first stop string in a growing text; knows how much text is safe to send
    (a tail that may be the start of a stop string is held back until it is not)."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1

    def find(self, text: str, start: int) -> int | None:
        """Index in `text` of the earliest stop string that ends at or after `start`."""
        begin = max(0, start - self.hold_back)
        hits = [i for i in (text.find(s, begin) for s in self.stop) if i >= 0]
        return min(hits) if hits else None


@dataclass
class TextDelta:
    """New output of one request since its previous delta."""

    text: str
    token_ids: list[int]
    num_output_tokens: int  # so far, including these
    finish_reason: str | None = None  # set on the last delta: stop | length
    logprobs: list | None = None  # Logprob of each of token_ids, when asked for
    prompt_logprobs: list | None = None  # on the first delta, when asked for
    queue_seconds: float | None = None  # on the first delta: arrival to first step
    # Set when a stop string cut the text: the output tokens that make up the text; those
    # sent in earlier deltas past it are to be dropped (a stop string spanning tokens).
    num_kept_tokens: int | None = None


async def text_deltas(
    engine: AsyncEngine,
    stream: RequestStream,
    tokenizer,
    stop: list[str],
    outputs=None,
    keep_special: frozenset[int] = frozenset(),
) -> AsyncIterator[TextDelta]:
    """Yield a request's TextDeltas until it finishes; the last one has a finish_reason.

    `outputs`: the stream's StepOutputs if not the stream itself (e.g. with its first
    output already read). `keep_special`: special token ids kept in the text. Leaving
    early (the client went away) aborts the request.
    """
    detokenizer = IncrementalDetokenizer(tokenizer, keep_special)
    stops = StopStrings(stop)
    sent = 0  # characters of detokenizer.text already yielded
    try:
        async for output in stream if outputs is None else outputs:
            if output.finish_reason == "error":
                raise RequestFailedError(
                    f"the request failed in the engine ({output.error}); the server log "
                    "has the details"
                )
            before = len(detokenizer.text)
            # A detokenizer that raises fails this request alone (a 500 or an error event
            # for its client, then its abort in `finally`); the engine never sees it.
            detokenizer.add(output.new_token_ids)
            if output.finished:
                detokenizer.finish()
            text = detokenizer.text
            cut = stops.find(text, before) if stop else None
            extras = dict(
                logprobs=output.logprobs,
                prompt_logprobs=output.prompt_logprobs,
                queue_seconds=output.queue_seconds,
            )
            if cut is not None:
                engine.abort(stream, reason="stop")
                # The tokens (and their logprobs) end with the one that completes text[:cut]:
                # those past the cut belong to the stop string, which the text leaves out.
                kept = detokenizer.tokens_for(cut)
                new = output.new_token_ids
                keep = max(0, len(new) - (len(detokenizer.token_ids) - kept))
                if extras["logprobs"] is not None:
                    extras["logprobs"] = extras["logprobs"][:keep]
                count = len(detokenizer.token_ids)
                yield TextDelta(text[sent:cut], new[:keep], count, "stop", num_kept_tokens=kept, **extras)  # fmt: skip
                return
            if output.finished:
                yield TextDelta(
                    text[sent:],
                    output.new_token_ids,
                    len(detokenizer.token_ids),
                    output.finish_reason,
                    **extras,
                )
                return
            safe = max(sent, len(text) - stops.hold_back) if stop else len(text)
            yield TextDelta(text[sent:safe], output.new_token_ids, len(detokenizer.token_ids), **extras)  # fmt: skip
            sent = safe
    finally:
        engine.abort(stream)  # a no-op once the request finished

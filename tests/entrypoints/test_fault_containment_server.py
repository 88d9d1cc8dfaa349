"""One bad request never takes the server down (issue 29, item 1).

The crafted request of the issue (a stop token id past the vocabulary) is a 400 naming the
field, and a greedy request after it gives the text it gave before. A fault injected in the
model forward or in the detokenizer while other requests run fails the culprit's request
alone (a 500, or an error event when streaming, with a message and no traceback); the
others get the reference text, /health stays 200 and every KV block comes back.
"""

from __future__ import annotations

import json
import threading

import pytest

from atom.entrypoints import sample_runs
from tests.engine_support import build_llm
from tests.entrypoints.server_support import (
    MAX_MODEL_LEN,
    MODEL,
    PROMPTS,
    greedy,
    raw_request,
    run_server,
)

MARK = 45_000  # a token id in the culprit's prompt only
CULPRIT = [200, 300, MARK, 400]


@pytest.fixture(scope="module")
def server(model_dir):
    """This module's own server: its tests patch the engine's model and the serving code."""
    server, stop = run_server(build_llm(model_dir, max_model_len=MAX_MODEL_LEN), MODEL)
    yield server
    stop()


def _complete(server, prompt, max_tokens=4, **fields):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
    return raw_request(server, "POST", "/v1/completions", body)


def _assert_error(body, status_type="server_error"):
    assert set(body) == {"error"} and body["error"]["type"] == status_type
    text = json.dumps(body)
    assert "Traceback" not in text and 'File "' not in text


def test_token_ids_outside_the_vocabulary_are_400s(server, reference):
    vocab = server.llm.engine.hf_config.vocab_size
    status, before = _complete(server, PROMPTS[0], 6, ignore_eos=True)
    assert status == 200
    crafted = {"prompt": "Hello", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [100000]}
    status, body = raw_request(server, "POST", "/v1/completions", crafted)
    assert status == 400, body
    _assert_error(body, "invalid_request_error")
    assert body["error"]["param"] == "stop_token_ids"
    message = body["error"]["message"]
    assert message == (
        f"stop_token_ids: token ids must be in the model's vocabulary [0, {vocab}); "
        "token id 100000 is not"
    )
    cases = [
        ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [2**40]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": [5, vocab]}, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {str(vocab): 1}}, "logit_bias"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "stop_token_ids": [vocab]},
            "stop_token_ids",
        ),
    ]
    for path, fields, param in cases:
        status, body = raw_request(
            server, "POST", path, {"max_tokens": 3, "min_tokens": 1, **fields}
        )
        assert status == 400, (fields, body)
        assert body["error"]["param"] == param, body
        bad = fields.get("stop_token_ids", [vocab])[0]
        assert f"vocabulary [0, {vocab}); token id {bad} is not" in body["error"]["message"]
    assert raw_request(server, "GET", "/health")[0] == 200
    status, after = _complete(server, PROMPTS[0], 6, ignore_eos=True)
    assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
    [expected] = greedy(reference, PROMPTS[0], 6, ignore_eos=True)
    assert after["choices"][0]["text"] == expected.text


def _run_with_others(server, culprit_request):
    """Three greedy requests run; once the engine holds them, `culprit_request()` is sent.
    Returns (the culprit's result, the others' (status, body))."""
    others: list = [None] * 3

    def send(i: int) -> None:
        others[i] = _complete(server, PROMPTS[i], 24, ignore_eos=True)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    engine = server.llm.engine
    while len(engine.scheduler.running) < 3 and any(t.is_alive() for t in threads):
        threading.Event().wait(0.002)
    result = culprit_request()
    for thread in threads:
        thread.join(120)
    return result, others


def _check_others(server, reference, others):
    expected = greedy(reference, PROMPTS, 24, ignore_eos=True)
    for (status, body), reference_output in zip(others, expected, strict=True):
        assert status == 200, body
        assert body["choices"][0]["text"] == reference_output.text
    assert raw_request(server, "GET", "/health")[0] == 200
    server.wait_idle()  # every KV block came back
    status, again = _complete(server, PROMPTS[1], 24, ignore_eos=True)
    assert status == 200 and again["choices"][0]["text"] == expected[1].text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_model_forward_fault_fails_only_its_request(server, reference, monkeypatch, stream):
    model = server.llm.engine.model_runner.model
    forward = model.forward
    fired = []

    def faulty_forward(input_ids, positions, *rest):
        if (input_ids == MARK).any():
            fired.append(True)
            raise RuntimeError("secret internal detail")
        return forward(input_ids, positions, *rest)

    monkeypatch.setattr(model, "forward", faulty_forward)
    (status, body), others = _run_with_others(
        server, lambda: _complete(server, CULPRIT, 8, stream=stream)
    )
    assert fired
    if stream:  # the headers went out before the failure: an error event, then [DONE]
        assert status == 200
        events = [e for e in body.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        body = json.loads(events[-2][6:])
    else:
        assert status == 500
    _assert_error(body)
    message = body["error"]["message"]
    assert "the step (model forward or sampler) failed (RuntimeError)" in message
    assert "secret" not in message
    _check_others(server, reference, others)
    assert server.engine.finished_requests["error"] >= 1


def test_detokenizer_fault_fails_only_its_request(server, reference, monkeypatch):
    """The culprit (marked by its stop string) detokenizes through a tokenizer that raises."""
    text_deltas = sample_runs.text_deltas
    fired = []

    class FaultyTokenizer:
        backend_tokenizer = None  # the window decoder, which calls `decode`

        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def __getattr__(self, name):
            return getattr(self.tokenizer, name)

        def decode(self, *args, **kwargs):
            fired.append(True)
            raise RuntimeError("secret internal detail")

    def faulty_text_deltas(engine, stream, tokenizer, stop, outputs=None, **options):
        if "<<fault>>" in stop:
            tokenizer = FaultyTokenizer(tokenizer)
        return text_deltas(engine, stream, tokenizer, stop, outputs, **options)

    monkeypatch.setattr(sample_runs, "text_deltas", faulty_text_deltas)
    (status, body), others = _run_with_others(
        server, lambda: _complete(server, PROMPTS[2], 8, stop=["<<fault>>"], ignore_eos=True)
    )
    assert fired
    assert status == 500, body
    _assert_error(body)
    assert "secret" not in body["error"]["message"]
    _check_others(server, reference, others)


def test_device_fault_stops_the_engine_and_health_says_so(model_dir, monkeypatch):
    llm = build_llm(model_dir, max_model_len=MAX_MODEL_LEN)
    server, stop = run_server(llm, MODEL)
    try:

        def broken_launch(batch):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(llm.engine.model_runner, "launch", broken_launch)
        status, body = _complete(server, "Hi")
        assert status == 503 and "illegal memory" not in json.dumps(body)
        assert raw_request(server, "GET", "/health")[0] == 503  # at once, no poll needed
        assert _complete(server, "Hi")[0] == 503
        server.wait_idle()
    finally:
        stop()

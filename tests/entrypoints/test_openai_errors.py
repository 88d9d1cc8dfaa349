"""Errors of the OpenAI-compatible server: OpenAI's shape, 4xx for bad requests, no traces.

Every invalid request gets a 4xx JSON error and leaves nothing in the engine; the server
keeps serving correct answers afterwards.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.engine_support import build_llm
from tests.entrypoints.server_support import (
    MAX_MODEL_LEN,
    MODEL,
    PROMPTS,
    greedy,
    raw_request,
    run_server,
)


# -- errors ------------------------------------------------------------------------------------
def _completion(**fields):
    return ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **fields})


def _chat(**fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return ("/v1/chat/completions", {**body, **fields})


INVALID_REQUESTS = {
    "malformed JSON": ("/v1/completions", '{"model": "tiny-llama", "prompt": '),
    "empty body": ("/v1/completions", ""),
    "body is a list": ("/v1/completions", [1, 2]),
    "no prompt": ("/v1/completions", {"model": MODEL, "max_tokens": 4}),
    "prompt is a number": _completion(prompt=5),
    "empty prompt": _completion(prompt=""),
    "empty prompt list": _completion(prompt=[]),
    "prompt mixes text and ids": _completion(prompt=[1, "a"]),
    "token id outside the vocabulary": _completion(prompt=[10**9]),
    "negative max_tokens": _completion(max_tokens=-1),
    "zero max_tokens": _completion(max_tokens=0),
    "max_tokens as a string": _completion(max_tokens="16"),
    "huge max_tokens": _completion(max_tokens=10**12),
    "temperature above 2": _completion(temperature=3.0),
    "negative temperature": _completion(temperature=-0.5),
    "temperature as a string": _completion(temperature="hot"),
    "top_p of 0": _completion(top_p=0),
    "top_p above 1": _completion(top_p=1.5),
    "top_k below -1": _completion(top_k=-5),
    "top_k beyond int64": _completion(top_k=2**70),
    "negative seed": _completion(seed=-1),
    "stream as a string": _completion(stream="yes"),
    "stop is a number": _completion(stop=5),
    "empty stop string": _completion(stop=[""]),
    "stop list of numbers": _completion(stop=[1, 2]),
    "n=0": _completion(n=0),
    "logprobs above 5": _completion(logprobs=6),
    "presence penalty above 2": _completion(presence_penalty=2.5),
    "best_of other than n": _completion(n=2, best_of=3),
    "tools in /v1/completions (a chat feature)": _completion(
        tools=[{"type": "function", "function": {"name": "f"}}]
    ),
    "chat: tool_choice naming no tool": _chat(
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "g"}},
    ),
    "invalid json schema": _completion(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    ),
    "unknown model": _completion(model="gpt-4"),
    "oversized token prompt": _completion(prompt=[200] * (MAX_MODEL_LEN + 10)),
    "oversized text prompt": _completion(prompt="word " * (2 * MAX_MODEL_LEN)),
    "chat: no messages key": ("/v1/chat/completions", {"model": MODEL}),
    "chat: empty messages": _chat(messages=[]),
    "chat: unknown role": _chat(messages=[{"role": "wizard", "content": "Hi"}]),
    "chat: content is a number": _chat(messages=[{"role": "user", "content": 5}]),
    "chat: message without content": _chat(messages=[{"role": "user"}]),
    "chat: negative max_tokens": _chat(max_tokens=-3),
    "chat: unknown model": _chat(model="gpt-4"),
    "chat: n=0": _chat(n=0),
    "chat: top_logprobs above 20": _chat(logprobs=True, top_logprobs=21),
    "chat: top_logprobs without logprobs": _chat(top_logprobs=2),
    "chat: oversized prompt": _chat(messages=[{"role": "user", "content": "x " * 1000}]),
}


@pytest.mark.parametrize("case", list(INVALID_REQUESTS))
def test_invalid_request_is_an_openai_error(server, case):
    path, body = INVALID_REQUESTS[case]
    status, error = raw_request(server, "POST", path, body)
    expected = 404 if "unknown model" in case else 400
    assert status == expected, (status, error)
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    message = error["error"]["message"]
    assert message and "Traceback" not in message and 'File "' not in message
    if "oversized" in case or "huge" in case:
        assert "max_model_len" in message


def test_openai_client_raises_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi")
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="Hi", n=1, best_of=2)


def test_unknown_route_and_method_are_openai_errors(server):
    status, body = raw_request(server, "GET", "/v1/nothing")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, body = raw_request(server, "GET", "/v1/completions")
    assert status == 405 and "message" in body["error"]


def test_serves_correct_answers_after_invalid_requests(server, reference):
    for path, body in list(INVALID_REQUESTS.values())[:10]:
        raw_request(server, "POST", path, body)
    expected = greedy(reference, PROMPTS, 6)
    result = server.client().completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0
    )
    assert [c.text for c in result.choices] == [o.text for o in expected]


def test_unexpected_failure_is_a_generic_500(server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(server.llm.engine.tokenizer, "apply_chat_template", broken)
    status, body = raw_request(server, "POST", *_chat())
    assert status == 500
    assert body["error"]["type"] == "server_error"
    assert "secret" not in json.dumps(body) and "Traceback" not in json.dumps(body)


def test_failure_mid_stream_is_an_error_event(server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(server.llm.engine.tokenizer, "decode", broken)
    body = {"prompt": "Hi", "max_tokens": 50, "ignore_eos": True, "stream": True}
    status, text = raw_request(server, "POST", "/v1/completions", body)
    assert status == 200  # the failure came after the headers
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["message"] == "internal server error"
    assert "secret" not in text
    server.wait_idle()  # the request was aborted


def test_engine_failure_fails_requests_and_health(model_dir, monkeypatch):
    llm = build_llm(model_dir, max_model_len=MAX_MODEL_LEN)
    server, stop = run_server(llm, MODEL)
    try:

        def broken_launch(batch):  # a device fault: only those stop the engine (issue 29)
            raise RuntimeError("CUDA error: device lost")

        monkeypatch.setattr(llm.engine.model_runner, "launch", broken_launch)
        status, body = raw_request(server, "POST", *_completion())
        assert status == 503 and "device lost" not in json.dumps(body)
        assert raw_request(server, "GET", "/health")[0] == 503
        server.wait_idle()  # the failed request's blocks were freed
    finally:
        stop()

"""Smaller defects of issue 29 (item 3), as a client sees them.

/tokenize refuses empty messages and invalid text with 400s; a NaN logit bias and a
min_tokens above max_tokens are 400s (as in vLLM); a stop string that cuts the output
cuts its logprobs tokens too; echo text offsets index the text, which skips special
tokens; /docs and /openapi.json need the API key, whose scheme is case-insensitive and
whose non-ASCII form matches.
"""

from __future__ import annotations

import json

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


def _assert_400(status, body, param):
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param, body
    assert "Traceback" not in json.dumps(body)


def test_tokenize_refuses_empty_messages_and_lone_surrogates(server, reference):
    status, body = raw_request(server, "POST", "/tokenize", {"messages": []})
    _assert_400(status, body, "messages")
    status, body = raw_request(server, "POST", "/tokenize", '{"prompt": "a\\udfff b"}')
    _assert_400(status, body, "prompt")
    assert "lone surrogate U+DFFF" in body["error"]["message"]
    messages = '{"messages": [{"role": "user", "content": "x\\ud800"}]}'
    status, body = raw_request(server, "POST", "/tokenize", messages)
    assert status == 400 and body["error"]["param"].startswith("messages[0]")
    # Valid requests still tokenize as the tokenizer does.
    status, body = raw_request(server, "POST", "/tokenize", {"prompt": "Hello world"})
    assert status == 200
    assert body["tokens"] == reference.tokenizer.encode("Hello world", add_special_tokens=True)


def test_nan_logit_bias_is_a_400(server, reference):
    for bias in ("NaN", "Infinity", "-Infinity"):
        body = '{"prompt": "Hi", "max_tokens": 2, "logit_bias": {"5": ' + bias + "}}"
        status, error = raw_request(server, "POST", "/v1/completions", body)
        _assert_400(status, error, "logit_bias")
        assert "finite" in error["error"]["message"]
    huge = '{"prompt": "Hi", "max_tokens": 2, "logit_bias": {"5": 1' + "0" * 400 + "}}"
    status, error = raw_request(server, "POST", "/v1/completions", huge)  # not a float
    assert status == 400 and error["error"]["param"].startswith("logit_bias"), error
    # A finite bias outside [-100, 100] is still clamped, as OpenAI and vLLM do.
    [expected] = greedy(reference, PROMPTS[0], 4, ignore_eos=True, logit_bias={5: -100.0})
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, result = raw_request(server, "POST", "/v1/completions", {**body, "logit_bias": {"5": -1e6}})  # fmt: skip
    assert status == 200 and result["choices"][0]["text"] == expected.text


def test_min_tokens_above_max_tokens_is_a_400(server):
    cases = [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "min_tokens": 5}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "min_tokens": 10**30}),
        ("/v1/completions", {"prompt": "Hi", "min_tokens": 17}),  # OpenAI's default: 16
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "min_tokens": 3},
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_completion_tokens": 2,
                "min_tokens": 3,
            },  # fmt: skip
        ),
    ]
    for path, body in cases:
        status, error = raw_request(server, "POST", path, body)
        _assert_400(status, error, "min_tokens")
        assert "must be at most max_tokens" in error["error"]["message"]
    # Equal is fine: exactly max_tokens tokens.
    body = {"prompt": "Hi", "max_tokens": 3, "min_tokens": 3, "temperature": 0}
    status, result = raw_request(server, "POST", "/v1/completions", body)
    assert status == 200 and result["usage"]["completion_tokens"] == 3


def _stop_string(reference, output):
    """(k, stop): a stop string equal to output token k's text, first seen there."""
    tok = reference.tokenizer
    for k in range(2, len(output.token_ids) - 1):
        stop = tok.decode([output.token_ids[k]])
        prefix = tok.decode(output.token_ids[:k])
        whole = tok.decode(output.token_ids[: k + 1])
        if stop.strip() and whole == prefix + stop and output.text.find(stop) == len(prefix):
            return k, stop
    pytest.skip("no usable stop string in the reference output")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_stop_string_cuts_the_logprobs_tokens_too(server, reference, stream):
    [output] = greedy(reference, PROMPTS[1], 16, ignore_eos=True)
    k, stop = _stop_string(reference, output)
    body = {
        "prompt": PROMPTS[1],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stop": [stop],
        "logprobs": 1,
        "stream": stream,
    }
    status, result = raw_request(server, "POST", "/v1/completions", body)
    assert status == 200
    if stream:
        chunks = [json.loads(e[6:]) for e in result.split("\n\n") if e and e != "data: [DONE]"]
        choices = [c["choices"][0] for c in chunks]
        text = "".join(c["text"] for c in choices)
        tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
        values = [v for c in choices if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
        reason = choices[-1]["finish_reason"]
    else:
        choice = result["choices"][0]
        text, reason = choice["text"], choice["finish_reason"]
        tokens = choice["logprobs"]["tokens"]
        values = choice["logprobs"]["token_logprobs"]
    tok = reference.tokenizer
    assert reason == "stop"
    assert text == tok.decode(output.token_ids[:k])
    assert tokens == [tok.decode([t]) for t in output.token_ids[:k]]  # not the stop token
    assert len(values) == k


def test_echo_text_offsets_skip_special_tokens(server, reference):
    tok = reference.tokenizer
    special = sorted(tok.all_special_ids)[:2]
    prompt = [special[0]] + tok.encode("Hello world") + [special[1]] + tok.encode(" again")
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 0}
    status, result = raw_request(server, "POST", "/v1/completions", body)
    assert status == 200
    choice = result["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    assert text.startswith("Hello world again")  # the text skips the special tokens
    checked = 0
    for token, offset, token_id in zip(
        logprobs["tokens"], logprobs["text_offset"], prompt, strict=False
    ):
        if token_id in tok.all_special_ids:
            continue
        assert text[offset : offset + len(token)] == token, (token, offset, text)
        checked += 1
    assert checked == len(prompt) - 2
    # Offsets never decrease and the generated tokens follow the echoed text.
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert logprobs["text_offset"][len(prompt)] == len(tok.decode(prompt, skip_special_tokens=True))


KEY = "sésame-ключ"  # non-ASCII: sent as UTF-8 bytes


@pytest.fixture(scope="module")
def keyed_server(model_dir):
    server, stop = run_server(build_llm(model_dir, max_model_len=MAX_MODEL_LEN), MODEL, api_key=KEY)
    yield server
    stop()


def _headers(authorization: bytes | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    return headers


def test_api_key_covers_docs_and_matches_case_and_utf8(keyed_server):
    server, key = keyed_server, KEY.encode("utf-8")
    for path in ("/docs", "/openapi.json", "/redoc", "/v1/models"):
        status, body = raw_request(server, "GET", path, headers=_headers(None))
        assert status == 401 and body["error"]["code"] == "invalid_api_key", path
    for scheme in (b"Bearer", b"bearer", b"BEARER"):
        headers = _headers(scheme + b" " + key)
        for path in ("/openapi.json", "/v1/models", "/docs"):
            assert raw_request(server, "GET", path, headers=headers)[0] == 200, (scheme, path)
    status, spec = raw_request(server, "GET", "/openapi.json", headers=_headers(b"Bearer " + key))
    assert "/v1/completions" in spec["paths"]
    wrong = [b"Bearer " + key[:-1], b"Basic " + key, key, b"Bearer", b"Bearer sesame-key"]
    for authorization in wrong:
        status, _ = raw_request(server, "GET", "/v1/models", headers=_headers(authorization))
        assert status == 401, authorization
    # The key's latin-1 reading (what a decoded header holds) is not the key.
    latin1 = b"Bearer " + KEY.encode("utf-8").decode("latin-1").encode("utf-8")
    assert raw_request(server, "GET", "/v1/models", headers=_headers(latin1))[0] == 401
    assert raw_request(server, "GET", "/health", headers=_headers(None))[0] == 200

"""A small request must not buy unbounded work (issue 29, item 2).

Each limit is a 400 naming the field (and the flag), a full server is a 503 with
Retry-After, a client that leaves while its request is admitted aborts it at once, and a
json_schema that would compile for minutes is refused in milliseconds. After each test a
fixed greedy request still gives the offline engine's text.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time

import pytest

from atom.entrypoints.request_limits import ServerLimits
from atom.model_engine.grammar_limits import GrammarLimits, pattern_repetition
from tests.engine_support import build_llm
from tests.entrypoints.server_support import (
    MAX_MODEL_LEN,
    MODEL,
    PROMPTS,
    greedy,
    raw_request,
    run_server,
)

MAX_PROMPTS = 8
MAX_SAMPLES = 16
MAX_QUEUED = 24
MAX_NUM_SEQS = 4  # few running at once: an n > 1 request's admission takes many steps
SHARE = 2  # one request's samples in the engine at once


@pytest.fixture(scope="module")
def server(model_dir):
    limits = ServerLimits(
        max_prompts_per_request=MAX_PROMPTS,
        max_samples_per_request=MAX_SAMPLES,
        max_queued_samples=MAX_QUEUED,
        max_samples_in_engine_per_request=SHARE,
    )
    llm = build_llm(model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)
    server, stop = run_server(llm, MODEL, limits=limits)
    yield server
    stop()


def _same_greedy_text(server, reference) -> None:
    """A fixed greedy request: the server's text is the offline engine's."""
    [expected] = greedy(reference, PROMPTS[1], 6, ignore_eos=True)
    body = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, result = raw_request(server, "POST", "/v1/completions", body)
    assert status == 200, result
    assert result["choices"][0]["text"] == expected.text


def _timed(server, body, path="/v1/completions"):
    start = time.monotonic()
    status, result = raw_request(server, "POST", path, body)
    return status, result, time.monotonic() - start


def test_prompt_caps_are_a_400_naming_the_field(server, reference):
    _same_greedy_text(server, reference)
    # Refused by the list's length, before its members are validated.
    status, error, seconds = _timed(server, {"prompt": [[1]] * 50_000, "max_tokens": 1})
    assert status == 400, error
    assert error["error"]["param"] == "prompt"
    assert "50000 prompts" in error["error"]["message"]
    assert "--max-prompts-per-request" in error["error"]["message"]
    assert seconds < 10
    strings = [f"Prompt {i}" for i in range(MAX_PROMPTS + 1)]
    status, error, _ = _timed(server, {"prompt": strings, "max_tokens": 1})
    assert status == 400 and error["error"]["param"] == "prompt"
    # prompts x n over the cap: 400 naming n
    body = {"prompt": strings[:MAX_PROMPTS], "n": MAX_SAMPLES // MAX_PROMPTS + 1, "max_tokens": 1}
    status, error, _ = _timed(server, body)
    assert status == 400, error
    assert error["error"]["param"] == "n"
    assert "--max-samples-per-request" in error["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "n": MAX_SAMPLES + 1}
    status, error, _ = _timed(server, chat, "/v1/chat/completions")
    assert status == 400 and error["error"]["param"] == "n"
    # At the caps: served, each prompt's greedy text the offline engine's.
    expected = greedy(reference, strings[:MAX_PROMPTS], 3, ignore_eos=True)
    body = {
        "prompt": strings[:MAX_PROMPTS],
        "n": MAX_SAMPLES // MAX_PROMPTS,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, result, _ = _timed(server, body)
    assert status == 200, result
    texts = [c["text"] for c in sorted(result["choices"], key=lambda c: c["index"])]
    n = MAX_SAMPLES // MAX_PROMPTS
    assert texts == [e.text for e in expected for _ in range(n)]
    _same_greedy_text(server, reference)


def test_a_full_server_answers_503_with_retry_after(server, reference):
    long_body = {
        "prompt": [f"Long {i}" for i in range(MAX_PROMPTS)],
        "n": MAX_SAMPLES // MAX_PROMPTS,
        "max_tokens": MAX_MODEL_LEN - 32,
        "ignore_eos": True,
        "stream": True,
    }
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request(
        "POST", "/v1/completions", json.dumps(long_body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: {")  # it holds MAX_SAMPLES samples now
    try:
        # MAX_SAMPLES + 9 > MAX_QUEUED: refused at once, with a hint when to retry.
        connection2 = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = {"prompt": [f"Other {i}" for i in range(3)], "n": 3, "max_tokens": 2}
        connection2.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        busy = connection2.getresponse()
        error = json.loads(busy.read())
        connection2.close()
        assert busy.status == 503, error
        assert busy.getheader("Retry-After") == "1"
        assert error["error"]["type"] == "server_error"
        assert "--max-queued-samples" in error["error"]["message"]
    finally:
        connection.close()
    server.wait_idle()
    # The stream's samples were given back: the same request is served now.
    deadline = time.monotonic() + 10
    while (status := raw_request(server, "POST", "/v1/completions", body)[0]) == 503:
        assert time.monotonic() < deadline, "the closed stream's samples were never released"
        time.sleep(0.05)
    assert status == 200
    _same_greedy_text(server, reference)


def _metrics(server) -> dict[str, float]:
    samples = {}
    for line in raw_request(server, "GET", "/metrics")[1].splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[re.sub(r"\{.*\}", "", name)] = float(value)
    return samples


@pytest.mark.parametrize("stream", [False, True])
def test_client_gone_during_admission_aborts_at_once(server, reference, stream):
    """n > 1: a prompt's other samples join once its first has a token, and at most SHARE
    of a request's samples are in the engine at once: admitting 8 prompts x n=2 of 200
    tokens each takes hundreds of steps; a client that leaves meanwhile must not keep
    them coming."""
    body = {
        "prompt": [f"Admit {i} slowly" for i in range(MAX_PROMPTS)],
        "n": MAX_SAMPLES // MAX_PROMPTS,
        "max_tokens": MAX_MODEL_LEN - 32,
        "ignore_eos": True,
        "stream": stream,
    }
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    deadline = time.monotonic() + 30
    while _metrics(server)["atom_requests_running"] < SHARE:
        assert time.monotonic() < deadline, "the request was never admitted"
        time.sleep(0.01)
    time.sleep(0.3)  # admission under way: the first samples decode, the rest wait
    connection.close()
    gone = time.monotonic()
    while True:
        now = _metrics(server)
        if now["atom_requests_running"] == now["atom_requests_waiting"] == 0:
            break
        assert time.monotonic() - gone < 2.0, (
            f"{now['atom_requests_running']:.0f} running, "
            f"{now['atom_requests_waiting']:.0f} waiting 2 s after the client left"
        )
        time.sleep(0.02)
    server.wait_idle()  # every KV block is free again
    _same_greedy_text(server, reference)


def _nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


COSTLY_SCHEMAS = {
    # (schema, the flag the 400 names); on main the first two compiled for over a minute
    "a counted regex": ({"type": "string", "pattern": "(a|b){20000}"}, "--max-schema-repetition"),
    "nested counts": (
        {"type": "string", "pattern": "((a|b){100}){100}"},
        "--max-schema-repetition",
    ),
    "deep nesting": (_nested_arrays(900), "--max-schema-depth"),
    "a long string": ({"type": "string", "maxLength": 10**9}, "--max-schema-repetition"),
    "a huge schema": (
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}},
        "--max-schema-bytes",
    ),
}


def _schema_request(schema: dict, max_tokens: int = 8) -> dict:
    return {
        "messages": [{"role": "user", "content": "Answer."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def test_costly_json_schemas_are_a_400_naming_the_field(server, reference):
    for case, (schema, flag) in COSTLY_SCHEMAS.items():
        status, error, seconds = _timed(server, _schema_request(schema), "/v1/chat/completions")
        assert status == 400, (case, error)
        assert error["error"]["param"] == "response_format", case
        assert flag in error["error"]["message"], (case, error)
        assert seconds < 5, (case, seconds)
    # Within the limits: compiled and enforced (the random model writes only what the
    # grammar allows, then stops).
    schema = {"type": "string", "pattern": "(a|b){3}"}
    status, result, _ = _timed(server, _schema_request(schema, 12), "/v1/chat/completions")
    assert status == 200, result
    assert re.fullmatch(r'\s*"[ab]{3}"\s*', result["choices"][0]["message"]["content"])
    _same_greedy_text(server, reference)


def test_pattern_repetition_counts_unrolled_copies():
    assert pattern_repetition("(a|b){20000}") == 20000
    assert pattern_repetition("((a|b){30}){30}") == 900
    assert pattern_repetition("a{2,5}b{7,}") == 7
    assert pattern_repetition(r"\{999\}[{1000}]x*") == 1  # escaped and in a class: literal
    assert pattern_repetition("(ab)+c?") == 1


def test_a_slow_compile_times_out_and_never_holds_shutdown(model_dir, reference):
    """A schema within relaxed limits that compiles for seconds (~6 s here; 74 s at
    {20000}): a 400 at the timeout, the server keeps answering (/tokenize included), and
    stopping it does not wait for the compile."""
    limits = ServerLimits(
        grammar=GrammarLimits(max_repetition=10**6, compile_timeout_s=0.3, compile_threads=1)
    )
    llm = build_llm(model_dir, max_model_len=MAX_MODEL_LEN)
    threads_before = set(threading.enumerate())
    server, stop = run_server(llm, MODEL, limits=limits)
    stopped = False
    try:
        slow = _schema_request({"type": "string", "pattern": "(a|b){4000}"})
        status, error, seconds = _timed(server, slow, "/v1/chat/completions")
        assert status == 400, error
        assert error["error"]["param"] == "response_format"
        assert "--grammar-compile-timeout" in error["error"]["message"]
        assert seconds < 5
        # The one compile thread is still busy: another compile cannot start in time (503),
        # but everything else is served at once.
        status, error, _ = _timed(
            server, _schema_request({"type": "integer"}), "/v1/chat/completions"
        )
        assert status == 503, error
        start = time.monotonic()
        status, tokens = raw_request(server, "POST", "/tokenize", {"prompt": "Hello"})
        assert status == 200 and tokens["count"] > 0
        assert time.monotonic() - start < 1.0
        _same_greedy_text(server, reference)
        server.wait_idle()
        start = time.monotonic()
        stopper = threading.Thread(target=stop)
        stopper.start()
        stopper.join(20)
        stopped = not stopper.is_alive()
        assert stopped and time.monotonic() - start < 3, "stopping waited for the compile"
    finally:
        if not stopped:
            stop()
        # The abandoned compile finishes on its daemon thread; let it, so the test process
        # does not end under it (xgrammar's C++ aborts when torn down mid-compile).
        for thread in set(threading.enumerate()) - threads_before:
            if thread.name.startswith("atom-grammar"):
                thread.join(60)


def test_health_answers_while_a_huge_prompt_list_is_refused(server):
    """The issue's body: 2 million one-token prompts, ~10 MB (under the body cap), once
    grew the server to 18 GB. Parsing it alone would hold the event loop for 1-2 s: it is
    refused by its count of JSON arrays, before it is parsed."""
    body = json.dumps({"prompt": [[1]] * 2_000_000, "max_tokens": 1})
    result: list = []
    sender = threading.Thread(
        target=lambda: result.append(raw_request(server, "POST", "/v1/completions", body))
    )
    start = time.monotonic()
    sender.start()
    latencies = []
    while sender.is_alive():
        asked = time.monotonic()
        assert raw_request(server, "GET", "/health")[0] == 200
        latencies.append(time.monotonic() - asked)
        time.sleep(0.02)
    sender.join()
    [(status, error)] = result
    assert status == 400, error
    assert "2000002 JSON arrays and objects" in error["error"]["message"]
    assert "--max-json-containers" in error["error"]["message"]
    # Brackets inside strings are text, not containers: this prompt is served.
    body = {"prompt": "[{" * 60_000, "max_tokens": 1}
    status, error = raw_request(server, "POST", "/v1/completions", body)
    assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
    assert time.monotonic() - start < 10
    assert max(latencies) < 1.0, f"/health took {max(latencies):.2f} s"


def test_a_large_request_does_not_hold_back_a_small_one(server, reference):
    """16 samples of 100 tokens arrive first; a 4-token request after them is served at
    once, with the offline engine's text: the large one holds SHARE of the 4 slots, not
    all of the queue (first come, first served would make it wait for ~3 waves of 100
    steps)."""
    big = {
        "prompt": [f"Big {i}" for i in range(MAX_PROMPTS)],
        "n": MAX_SAMPLES // MAX_PROMPTS,
        "max_tokens": 100,
        "ignore_eos": True,
    }
    finished: list = []
    sender = threading.Thread(target=lambda: finished.append(_timed(server, big)), daemon=True)
    sender.start()
    deadline = time.monotonic() + 30
    while _metrics(server)["atom_requests_running"] < SHARE:
        assert time.monotonic() < deadline, "the large request was never admitted"
        time.sleep(0.01)
    [expected] = greedy(reference, PROMPTS[2], 4, ignore_eos=True)
    body = {"prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, result, seconds = _timed(server, body)
    assert status == 200 and result["choices"][0]["text"] == expected.text
    assert not finished, "the large request ended first: the test proves nothing"
    sender.join(300)
    [(status, result, big_seconds)] = finished
    assert status == 200 and len(result["choices"]) == MAX_SAMPLES
    assert all(c["finish_reason"] == "length" for c in result["choices"])
    # Behind the large request's queue it would wait most of its time (about 350 of its
    # 400 steps); served at the next free slot, a few steps of its 800 (SHARE = 2).
    assert seconds < 0.2 * big_seconds, (seconds, big_seconds)


def test_limit_flags_reach_the_server_and_bad_values_name_the_flag():
    from atom.entrypoints.openai_server import build_parser
    from atom.entrypoints.request_limits import limits_from_args

    args = build_parser().parse_args(
        ["--max-prompts-per-request", "3", "--max-samples-per-request", "5"]
        + ["--max-queued-samples", "7", "--max-json-containers", "11"]
        + ["--max-samples-in-engine-per-request", "2", "--max-schema-bytes", "100"]
        + ["--max-schema-depth", "4", "--max-schema-repetition", "9"]
        + ["--grammar-compile-timeout", "0.5", "--grammar-compile-threads", "1"]
    )
    limits = limits_from_args(args)
    assert limits == ServerLimits(
        max_prompts_per_request=3,
        max_samples_per_request=5,
        max_queued_samples=7,
        max_json_containers=11,
        max_samples_in_engine_per_request=2,
        grammar=GrammarLimits(
            max_schema_bytes=100,
            max_schema_depth=4,
            max_repetition=9,
            compile_timeout_s=0.5,
            compile_threads=1,
        ),
    )
    defaults = limits_from_args(build_parser().parse_args([]))
    assert defaults == ServerLimits()
    with pytest.raises(ValueError, match="--max-prompts-per-request must be at least 1"):
        limits_from_args(build_parser().parse_args(["--max-prompts-per-request", "0"]))
    with pytest.raises(ValueError, match="--grammar-compile-timeout"):
        limits_from_args(build_parser().parse_args(["--grammar-compile-timeout", "0"]))


def test_a_sample_refused_after_the_first_share_fails_the_request(server, monkeypatch):
    """Prompts beyond the request's share are admitted later; if the engine refuses one
    then, the client still gets the engine's 400 and nothing is left behind."""
    real_add_request = server.llm.engine.add_request

    def add_request(prompt, params):
        if prompt == [7, 7, 7]:
            raise ValueError("refused for the test")
        return real_add_request(prompt, params)

    monkeypatch.setattr(server.llm.engine, "add_request", add_request)
    body = {"prompt": [[5, 6, 7], [5, 6, 8], [7, 7, 7]], "max_tokens": 50, "ignore_eos": True}
    assert len(body["prompt"]) > SHARE
    status, error = raw_request(server, "POST", "/v1/completions", body)
    assert status == 400 and error["error"]["message"] == "refused for the test", error
    server.wait_idle()


def test_the_engine_thread_never_compiles_a_grammar(server, reference, monkeypatch):
    """The server compiles a request's schema on its grammar pool (within the timeout) and
    hands the compiled grammar to the engine, so the engine thread never compiles one, even
    when xgrammar's cache no longer holds the schema (here: a cache that never hits)."""
    from atom.model_engine.sampling.structured_output import GrammarBackend

    threads = []
    original = GrammarBackend.compile

    def recording_compile(self, params):
        threads.append(threading.current_thread().name)
        self.compiler.clear_cache()  # the engine's compile would miss the cache
        return original(self, params)

    monkeypatch.setattr(GrammarBackend, "compile", recording_compile)
    schema = {"type": "string", "pattern": "(a|b){4}"}
    status, result, _ = _timed(server, _schema_request(schema, 12), "/v1/chat/completions")
    assert status == 200, result
    assert re.fullmatch(r'\s*"[ab]{4}"\s*', result["choices"][0]["message"]["content"])
    body = {
        "prompt": ["Answer.", "Say it."],
        "max_tokens": 12,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    status, result = raw_request(server, "POST", "/v1/completions", body)
    assert status == 200, result
    for choice in result["choices"]:
        assert re.fullmatch(r'\s*"[ab]{4}"\s*', choice["text"]), choice
    assert threads and all(name.startswith("atom-grammar") for name in threads), threads
    _same_greedy_text(server, reference)

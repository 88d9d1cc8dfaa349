"""The server against hostile or careless clients (issue 14, server items 9-14).

Invalid text is a 400 naming the field, not a 500; huge bodies are a 413; a huge prompt
does not freeze /health; tiny temperatures are greedy; a request of many prompts joins
the engine at once and leaves it at once; SIGINT ends the process cleanly.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from atom.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from tests.engine_support import build_llm
from tests.entrypoints.server_support import (
    MAX_MODEL_LEN,
    MODEL,
    PROMPTS,
    greedy,
    parse_metrics,
    raw_request,
    run_server,
)

MAX_REQUEST_BYTES = 4 << 20  # this module's server: small enough to exceed cheaply


@pytest.fixture(scope="module")
def server(model_dir):
    server, stop = run_server(
        build_llm(model_dir, max_model_len=MAX_MODEL_LEN),
        MODEL,
        max_request_bytes=MAX_REQUEST_BYTES,
    )
    yield server
    stop()


def _metrics(server) -> dict[str, float]:
    samples = parse_metrics(raw_request(server, "GET", "/metrics")[1])
    return {
        # prometheus_client sorts labels: model_name may come before or after another
        re.sub(r',?model_name="[^"]*"', "", name).replace("{,", "{").replace("{}", ""): value
        for name, value in samples.items()
    }


# -- item 9: a lone surrogate is a 400 naming the field ----------------------------------------
# Raw JSON text: `\ud800` is a valid JSON escape, but a lone surrogate is not Unicode text.
LONE_SURROGATES = {
    "prompt": ("/v1/completions", '{"prompt": "abc \\ud800 def", "max_tokens": 2}', "prompt"),
    "one prompt of several": (
        "/v1/completions",
        '{"prompt": ["fine", "abc \\udfff def"], "max_tokens": 2}',
        "prompt",
    ),
    "stop string": (
        "/v1/completions",
        '{"prompt": "Hi", "stop": ["\\ud800"], "max_tokens": 2}',
        "stop",
    ),
    "chat message": (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "abc \\ud800 def"}], "max_tokens": 2}',
        "messages[0].content",
    ),
    "chat content part": (
        "/v1/chat/completions",
        '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": '
        '[{"type": "text", "text": "ok"}, {"type": "text", "text": "x\\ud800"}]}], "max_tokens": 2}',
        "messages[1].content",
    ),
}


def test_lone_surrogate_is_a_400_naming_the_field(server, reference):
    for case, (path, body, field) in LONE_SURROGATES.items():
        status, error = raw_request(server, "POST", path, body)
        assert status == 400, (case, status, error)
        assert error["error"]["param"] == field, case
        assert error["error"]["message"].startswith(f"{field}: not valid Unicode text"), case
        assert "lone surrogate U+D" in error["error"]["message"], case
    # The escaped pair of one emoji is valid text: it is tokenized as the emoji.
    [expected] = greedy(reference, "smile \U0001f600", 3)
    body = '{"prompt": "smile \\ud83d\\ude00", "max_tokens": 3, "temperature": 0}'
    status, result = raw_request(server, "POST", "/v1/completions", body)
    assert status == 200 and result["choices"][0]["text"] == expected.text


# -- item 13: stream_options without stream is a 400 -------------------------------------------
def test_stream_options_without_stream_is_a_400(server):
    requests = {
        "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    }
    for path, base in requests.items():
        for stream in ({}, {"stream": False}):
            body = {**base, **stream, "stream_options": {"include_usage": True}}
            status, error = raw_request(server, "POST", path, body)
            assert status == 400, (path, stream, status, error)
            assert error["error"]["param"] == "stream_options"
            assert "only allowed when stream is true" in error["error"]["message"]
        # null means "not given"
        assert raw_request(server, "POST", path, {**base, "stream_options": None})[0] == 200
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        server.client().completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, stream_options={"include_usage": True}
        )


# -- item 11: temperatures below an epsilon are greedy -----------------------------------------
def test_tiny_temperature_is_greedy_at_the_boundary(server, reference):
    below = GREEDY_TEMPERATURE * (1 - 1e-9)
    [expected] = greedy(reference, PROMPTS[0], 8, ignore_eos=True)
    assert expected.text  # the check below would be empty text without the fix
    client = server.client()
    for temperature in (1e-45, 1e-38, 1e-30, below):
        result = client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=8,
            temperature=temperature,
            extra_body={"ignore_eos": True},
        )
        assert result.choices[0].text == expected.text, temperature
    assert SamplingParams(temperature=below).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy  # the boundary samples
    # Offline generation takes the same path.
    params = SamplingParams(temperature=1e-38, max_tokens=8, ignore_eos=True)
    [offline] = reference.generate(PROMPTS[0], params, use_tqdm=False)
    assert offline.token_ids == expected.token_ids
    # At the boundary the sampler runs (seeded), and its logits stay finite: valid tokens.
    result = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=8,
        temperature=GREEDY_TEMPERATURE,
        seed=0,
        extra_body={"ignore_eos": True},
    )
    assert result.choices[0].text == expected.text


# -- item 10: a request body cap (413); a huge prompt does not freeze the event loop -----------
def test_oversized_body_is_a_413(server, reference):
    # Declared by Content-Length: refused before the body is sent.
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(10**12))
    connection.endheaders()  # no body follows: the server must not wait for it
    response = connection.getresponse()
    body = json.loads(response.read())
    connection.close()
    assert response.status == 413
    assert response.getheader("connection") == "close"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert f"limit of {MAX_REQUEST_BYTES} bytes" in body["error"]["message"]

    # Chunked, no Content-Length: counted as it arrives.
    connection = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    connection.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b" " * (1 << 20)
    for _ in range(MAX_REQUEST_BYTES // len(chunk)):
        connection.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    connection.sendall(b"1\r\n \r\n")  # one byte over; no last chunk: none must be needed
    response = b""
    while data := connection.recv(65536):
        response += data
    connection.close()
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert f"limit of {MAX_REQUEST_BYTES} bytes" in json.loads(body)["error"]["message"]

    # Under the limit: served.
    [expected] = greedy(reference, PROMPTS[1], 4)
    padding = " " * (MAX_REQUEST_BYTES // 2)  # JSON whitespace: a big body, a small request
    body = padding + json.dumps({"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0})
    status, result = raw_request(server, "POST", "/v1/completions", body)
    assert status == 200 and result["choices"][0]["text"] == expected.text


def test_health_answers_while_huge_prompts_are_tokenized(server):
    """A 1.25 MB prompt takes ~1 s to tokenize here; /health must answer meanwhile (the
    same for a chat message that large, rendered through the chat template)."""
    text = "word " * 250_000
    huge = [
        ("/v1/completions", {"prompt": text, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
    ]
    results: list = [None] * len(huge)

    def send(i: int) -> None:
        results[i] = raw_request(server, "POST", *huge[i])

    senders = [threading.Thread(target=send, args=(i,)) for i in range(len(huge))]
    for sender in senders:
        sender.start()
    latencies = []
    while any(s.is_alive() for s in senders):
        start = time.monotonic()
        assert raw_request(server, "GET", "/health")[0] == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.02)
    for sender in senders:
        sender.join()
    for status, error in results:
        assert status == 400 and error["error"]["code"] == "context_length_exceeded"
    assert max(latencies) < 0.5, f"/health took {max(latencies):.2f} s"
    assert len(latencies) >= 5  # /health was asked while the prompts were tokenized


# -- item 12: many prompts join at once and leave at once --------------------------------------
def test_many_prompts_are_admitted_together_and_aborted_on_disconnect(server, monkeypatch):
    count = 100  # its prefill is one short step on CPU (which the aborts wait for)
    before = _metrics(server)
    steps = server.engine.steps
    body = {
        "prompt": [f"Prompt {i}: tell me about {i * 7}" for i in range(count)],
        "max_tokens": MAX_MODEL_LEN - 32,
        "ignore_eos": True,
        "temperature": 0,
    }
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    deadline = time.monotonic() + 30
    while not server.llm.engine.has_unfinished():
        assert time.monotonic() < deadline, "the request was never admitted"
        time.sleep(0.002)
    connection.close()  # the client goes away as soon as the first prompt runs
    gone = time.monotonic()
    while True:
        now = _metrics(server)
        if now["atom_requests_running"] == now["atom_requests_waiting"] == 0:
            break
        assert time.monotonic() - gone < 1.0, (
            f"{now['atom_requests_running']:.0f} running, "
            f"{now['atom_requests_waiting']:.0f} waiting 1 s after the client left"
        )
        time.sleep(0.01)
    server.wait_idle()
    after = _metrics(server)
    assert after["atom_requests_total"] - before["atom_requests_total"] == count
    aborted = 'atom_requests_finished_total{finish_reason="abort"}'
    assert after[aborted] - before[aborted] == count
    # Admitted in one command: a few engine steps in all, not one step per prompt.
    assert server.engine.steps - steps < count // 4

    # All or none: when the engine refuses one prompt, the ones before it are taken back.
    real_add_request = server.llm.engine.add_request

    def add_request(prompt, params):
        if prompt == [7, 7, 7]:
            raise ValueError("refused for the test")
        return real_add_request(prompt, params)

    monkeypatch.setattr(server.llm.engine, "add_request", add_request)
    body = {"prompt": [[5, 6, 7], [5, 6, 8], [7, 7, 7]], "max_tokens": 50, "ignore_eos": True}
    status, error = raw_request(server, "POST", "/v1/completions", body)
    assert status == 400 and error["error"]["message"] == "refused for the test"
    server.wait_idle()  # no request and no KV block left behind
    assert _metrics(server)[aborted] - after[aborted] == 2


# -- item 14: SIGINT ends the process cleanly --------------------------------------------------
def test_sigint_shuts_down_cleanly_with_one_line(model_dir):
    command = [sys.executable, "-m", "atom.entrypoints.openai_server", "--model", model_dir]
    command += ["--device", "cpu", "--port", "0", "--max-model-len", str(MAX_MODEL_LEN)]
    command += ["--kv-cache-memory-gb", "0.01"]  # the default log level: info
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    process = subprocess.Popen(command, cwd=root, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        port = None
        while port is None:
            line = process.stderr.readline()
            assert line, "the server exited: " + "".join(lines)
            lines.append(line)
            found = re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)", line)
            port = found and int(found.group(1))
        rest: list[str] = []
        reader = threading.Thread(target=lambda: rest.extend(process.stderr), daemon=True)
        reader.start()

        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}
        connection.request(
            "POST",
            "/v1/completions",
            json.dumps({**body, "stream": True}),
            {"Content-Type": "application/json"},
        )
        response = connection.getresponse()
        assert response.readline().startswith(b"data: {")
        process.send_signal(signal.SIGINT)
        events = [e for e in response.read().decode().split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["message"] == "the server is shutting down"
        assert process.wait(30) == 0
        reader.join(10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    output = "".join(lines + rest)
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    # After the start line: the stream's access-log line, then one line for the shutdown.
    after_start = [line for line in rest if not re.search(r'HTTP/1\.1" \d{3}', line)]
    assert after_start == ["atom: shut down (SIGINT)\n"], output

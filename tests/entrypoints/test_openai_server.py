"""The OpenAI-compatible server, end to end: uvicorn in a thread, the official client.

Completions and chat (streaming or not) equal offline greedy generation; requests join
the running batch; disconnects abort; /metrics; the command line.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time

from atom.entrypoints import openai_server
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm
from tests.entrypoints.server_support import (
    MAX_MODEL_LEN,
    MODEL,
    PROMPTS,
    Server,
    greedy,
    parse_metrics,
    raw_request,
    run_server,
)


# -- basics ------------------------------------------------------------------------------------
def test_health_and_models(server):
    assert raw_request(server, "GET", "/health")[0] == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_equals_offline_greedy(server, reference):
    expected = greedy(reference, PROMPTS, 12)
    result = server.client().completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == [o.text for o in expected]
    assert [c.finish_reason for c in result.choices] == [o.finish_reason for o in expected]
    assert result.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert result.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_completion_stream_equals_offline_greedy(server, reference):
    [expected] = greedy(reference, PROMPTS[0], 20, ignore_eos=True)
    stream = server.client().completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(expected.prompt_token_ids), 20)


def test_token_id_prompts_and_echo(server, reference):
    ids = reference.engine.tokenize(PROMPTS[1])
    expected = greedy(reference, [ids, ids[:3]], 8)
    client = server.client()
    single = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert single.choices[0].text == expected[0].text
    batch = client.completions.create(
        model=MODEL, prompt=[ids, ids[:3]], max_tokens=8, temperature=0
    )
    assert [c.text for c in batch.choices] == [o.text for o in expected]
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPTS[1] + expected[0].text


def test_chat_equals_offline_greedy(server, reference):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a GPU?"},
    ]
    [expected] = greedy(reference, [reference.chat_prompt(messages)], 10)
    client = server.client()
    result = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.token_ids)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_stream_is_sse_ending_with_done(server):
    status, text = raw_request(
        server,
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
    )
    assert status == 200
    events = [line for line in text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_stop_strings_cut_the_text(server, reference):
    [full] = greedy(reference, PROMPTS[0], 30, ignore_eos=True)
    stop = full.text[10:13]
    expected = full.text[: full.text.index(stop)]
    client = server.client()
    for stream in (False, True):
        result = client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=30,
            temperature=0,
            stop=["never appears", stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        choices = [c.choices[0] for c in result] if stream else result.choices
        assert "".join(c.text for c in choices) == expected
        assert choices[-1].finish_reason == "stop"


def test_seeded_sampling_equals_offline(server, reference):
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, max_tokens=12, seed=1234)
    [expected] = reference.generate(PROMPTS[2], params, use_tqdm=False)
    result = server.client().completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        max_tokens=12,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        extra_body={"top_k": 50},
    )
    assert result.choices[0].text == expected.text


# -- continuous batching -----------------------------------------------------------------------
def test_32_concurrent_streams_equal_offline_greedy(server, reference):
    prompts = [f"Request number {i}: tell me about {'abc' * (i % 5)}" for i in range(32)]
    max_tokens = [4 + i % 13 for i in range(32)]
    expected = [
        greedy(reference, p, n, ignore_eos=True)[0].text
        for p, n in zip(prompts, max_tokens, strict=True)
    ]
    steps_before = server.engine.steps

    async def one(client, prompt, n) -> str:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them():
        client = server.async_client()
        try:
            return await asyncio.gather(
                *(one(client, p, n) for p, n in zip(prompts, max_tokens, strict=True))
            )
        finally:
            await client.close()

    assert asyncio.run(all_of_them()) == expected
    server.wait_idle()
    # Batched: far fewer engine steps than generated tokens.
    assert server.engine.steps - steps_before < sum(max_tokens) / 2


def test_new_request_joins_the_running_batch(server, reference):
    """A short request sent while a long one streams finishes first: it did not wait."""
    # References first, only to keep the timing of the two requests clean.
    [expected] = greedy(reference, PROMPTS[1], 5, ignore_eos=True)
    [long_expected] = greedy(reference, PROMPTS[0], MAX_MODEL_LEN - 16, ignore_eos=True)
    client = server.client()
    long_stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=MAX_MODEL_LEN - 16,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(long_stream))
    short = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert short.choices[0].text == expected.text
    assert server.llm.engine.has_unfinished()  # the long request is still generating
    rest = [c.choices[0] for c in long_stream]
    assert rest[-1].finish_reason == "length"
    assert first.choices[0].text + "".join(c.text for c in rest) == long_expected.text


# -- disconnects -------------------------------------------------------------------------------
def test_client_disconnect_mid_stream_aborts(server):
    aborted = server.engine.finished_requests["abort"]
    generated = server.llm.engine.stats.generated_tokens
    stream = server.client().completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=MAX_MODEL_LEN - 16,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()
    server.wait_idle()
    assert server.engine.finished_requests["abort"] == aborted + 1
    assert server.llm.engine.stats.generated_tokens - generated < MAX_MODEL_LEN - 16


def test_client_disconnect_while_waiting_for_a_full_response_aborts(server):
    aborted = server.engine.finished_requests["abort"]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    deadline = time.monotonic() + 30
    while not server.llm.engine.has_unfinished():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    connection.close()
    server.wait_idle()
    assert server.engine.finished_requests["abort"] == aborted + 1


def test_shutdown_ends_open_streams(model_dir):
    server, stop = run_server(build_llm(model_dir, max_model_len=MAX_MODEL_LEN), MODEL)
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True, "stream": True}
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.readline().startswith(b"data: {")
    stop()  # returns once the server has exited: the stream must not hold it
    events = [e for e in response.read().decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["message"] == "the server is shutting down"
    server.wait_idle()


# -- metrics -----------------------------------------------------------------------------------
def test_metrics_in_prometheus_format(server):
    server.client().completions.create(model=MODEL, prompt="Count", max_tokens=5, temperature=0)
    server.wait_idle()
    status, text = raw_request(server, "GET", "/metrics")
    assert status == 200
    samples = parse_metrics(text)
    label = f'{{model_name="{MODEL}"}}'
    for name in (
        "atom_requests_total",
        "atom_prompt_tokens_total",
        "atom_generation_tokens_total",
        "atom_step_seconds_sum",
        "atom_step_seconds_count",
    ):
        assert samples[name + label] > 0, name
    for name in ("atom_requests_running", "atom_requests_waiting", "atom_kv_cache_usage_ratio"):
        assert samples[name + label] == 0, name
    for name in ("atom_h2d_copies_total", "atom_h2d_bytes_total", "atom_h2d_copies_last_step"):
        assert name + label in samples  # 0 on CPU with the direct backend: nothing to copy
    # prometheus_client writes labels in sorted order
    finished = f'atom_requests_finished_total{{finish_reason="length",model_name="{MODEL}"}}'
    assert samples[finished] >= 1
    assert re.search(r"^# TYPE atom_requests_total counter$", text, re.M)


# -- the command line --------------------------------------------------------------------------
def test_command_line_server(model_dir):
    """`python -m atom.entrypoints.openai_server` with port 0 and the packed h2d backend."""
    command = [sys.executable, "-m", "atom.entrypoints.openai_server", "--model", model_dir]
    command += ["--device", "cpu", "--port", "0", "--max-model-len", "64"]
    command += ["--kv-cache-memory-gb", "0.01", "--h2d-backend", "packed", "--log-level", "warning"]
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
        threading.Thread(target=process.stderr.read, daemon=True).start()  # keep the pipe drained
        cli = Server(f"http://127.0.0.1:{port}", port, None, None)
        assert raw_request(cli, "GET", "/health")[0] == 200
        name = model_dir  # the default served name: --model as given
        status, body = raw_request(
            cli, "POST", "/v1/completions", {"model": name, "prompt": "Hi", "max_tokens": 3}
        )
        assert status == 200 and body["usage"]["completion_tokens"] <= 3
        samples = parse_metrics(raw_request(cli, "GET", "/metrics")[1])
        label = f'{{model_name="{name}"}}'
        assert samples["atom_h2d_copies_last_step" + label] >= 1  # packed: one copy a step
        assert samples["atom_h2d_bytes_total" + label] > 0
    finally:
        process.terminate()
        process.wait(30)


def test_command_line_errors_are_messages(tmp_path, capsys):
    code = openai_server.main(
        ["--model", str(tmp_path / "missing"), "--device", "cpu", "--port", "0"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "does not exist" in err and "Traceback" not in err

"""The server over engines unlike the default one: tensor parallel (2 ranks on gloo), and a
KV cache of two blocks."""

from __future__ import annotations

import pytest

from tests.engine_support import build_llm
from tests.entrypoints.server_support import (
    MAX_MODEL_LEN,
    MODEL,
    greedy,
    parse_metrics,
    raw_request,
    run_server,
)

MESSAGES = [{"role": "user", "content": "What is a GPU?"}]


@pytest.fixture
def tp_server(model_dir):
    llm = build_llm(
        model_dir, max_model_len=MAX_MODEL_LEN, tensor_parallel_size=2, h2d_backend="packed"
    )
    server, stop = run_server(llm, MODEL)
    try:
        yield server
    finally:
        stop()
        llm.shutdown()


def test_tensor_parallel_server_answers_chat_streaming_and_metrics(tp_server, reference):
    """`-tp 2`: every request used to fail (EngineDeadError) because the server read the
    runner's slots, which live on the ranks; H2D totals now come from rank 0's slots."""
    [expected] = greedy(reference, [reference.chat_prompt(MESSAGES)], 8)
    client = tp_server.client()
    result = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert result.choices[0].message.content == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    tp_server.wait_idle()
    status, text = raw_request(tp_server, "GET", "/metrics")
    assert status == 200
    samples = parse_metrics(text)
    label = f'{{model_name="{MODEL}"}}'
    assert samples["atom_requests_total" + label] == 2
    assert samples["atom_generation_tokens_total" + label] == 2 * len(expected.token_ids)
    # Packed publication on rank 0: one copy per step, so at least one per engine step.
    assert samples["atom_h2d_copies_total" + label] >= samples["atom_step_seconds_count" + label]
    assert samples["atom_h2d_bytes_total" + label] > 0
    assert samples["atom_h2d_copies_last_step" + label] >= 1


def test_two_block_cache_refuses_what_cannot_fit_and_serves_the_rest(model_dir, reference):
    """2 blocks of 16 tokens: max_model_len becomes 32 (the cache), so max_tokens=100 is
    a 400 naming the limit (it used to be accepted and hang, /health still 200), and a
    request that fits gets its greedy tokens."""
    llm = build_llm(model_dir, num_kvcache_blocks=2)
    server, stop = run_server(llm, MODEL)
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 100, "temperature": 0}
        status, answer = raw_request(server, "POST", "/v1/completions", body)
        assert status == 400, answer
        assert answer["error"]["param"] == "max_tokens" and "32" in answer["error"]["message"]
        prompt_len = len(reference.engine.tokenize("Hello"))
        body.update(max_tokens=32 - prompt_len, ignore_eos=True)
        status, answer = raw_request(server, "POST", "/v1/completions", body)
        assert status == 200, answer
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 32 - prompt_len
        short = greedy(reference, ["Hello"], 32 - prompt_len, ignore_eos=True)[0]
        assert answer["choices"][0]["text"] == short.text
        server.wait_idle()
    finally:
        stop()

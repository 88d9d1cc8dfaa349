"""OpenAI API parity with vLLM (issue 16), through the official `openai` client.

Logprobs (completions, chat, echo, streaming) equal the offline engine's (which
tests/model_engine/test_sampling_options.py checks against HF); n > 1; sampling options;
tokenizer endpoints; API keys; unknown fields; prometheus metrics.
"""

from __future__ import annotations

import logging

import openai
import pytest

from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm
from tests.entrypoints.server_support import (
    MAX_MODEL_LEN,
    MODEL,
    PROMPTS,
    parse_metrics,
    raw_request,
    run_server,
)


def _offline(reference, prompt, **params):
    [out] = reference.generate([prompt], SamplingParams(temperature=0, **params), use_tqdm=False)
    return out


# -- logprobs -----------------------------------------------------------------------------------
def test_completion_logprobs_equal_offline(server, reference):
    expected = _offline(reference, PROMPTS[0], max_tokens=6, logprobs=3, ignore_eos=True)
    result = server.client().completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = result.choices[0].logprobs
    tokenizer = reference.tokenizer
    assert lp.tokens == [tokenizer.decode([t]) for t in expected.token_ids]
    for value, entry in zip(lp.token_logprobs, expected.logprobs, strict=True):
        assert abs(value - entry.logprob) < 1e-5
    for top, entry in zip(lp.top_logprobs, expected.logprobs, strict=True):
        assert len(top) <= 4  # the chosen token plus the top 3 (greedy: it is among them)
        assert max(top.values()) == pytest.approx(entry.top[0][1], abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_logprobs_with_max_tokens_zero(server, reference):
    """What lm-eval-harness sends for log-likelihoods: the prompt's logprobs, first null."""
    ids = reference.engine.tokenize(PROMPTS[1])
    expected = _offline(reference, ids, max_tokens=1, prompt_logprobs=1)
    result = server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = result.choices[0]
    assert choice.text == reference.engine.decode(ids)
    lp = choice.logprobs
    assert (
        len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    )
    for value, entry in zip(lp.token_logprobs[1:], expected.prompt_logprobs[1:], strict=True):
        assert abs(value - entry.logprob) < 1e-5
    assert result.usage.completion_tokens <= 1


def test_echo_logprobs_then_generation(server, reference):
    ids = reference.engine.tokenize(PROMPTS[2])
    expected = _offline(reference, ids, max_tokens=3, logprobs=0, prompt_logprobs=0, ignore_eos=True)  # fmt: skip
    result = server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=3, echo=True, logprobs=0, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = result.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 3
    want = [e.logprob for e in expected.prompt_logprobs[1:]] + [
        e.logprob for e in expected.logprobs
    ]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])


def test_streamed_completion_logprobs_equal_whole(server):
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2)
    kwargs["extra_body"] = {"ignore_eos": True}
    whole = server.client().completions.create(**kwargs).choices[0].logprobs
    chunks = [c for c in server.client().completions.create(stream=True, **kwargs) if c.choices]
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert streamed == pytest.approx(whole.token_logprobs, abs=1e-4)


def test_chat_logprobs_stream_and_whole(server, reference):
    messages = [{"role": "user", "content": "Say something."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True)
    kwargs.update(top_logprobs=4, extra_body={"ignore_eos": True})
    whole = server.client().chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 4 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert "".join(c.token for c in content) == whole.choices[0].message.content
    streamed = [
        c
        for chunk in server.client().chat.completions.create(stream=True, **kwargs)
        for choice in chunk.choices
        if choice.logprobs
        for c in choice.logprobs.content
    ]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    # Without logprobs: null, as before.
    kwargs.pop("top_logprobs")
    kwargs["logprobs"] = False
    assert server.client().chat.completions.create(**kwargs).choices[0].logprobs is None


# -- n > 1 --------------------------------------------------------------------------------------
def test_n_streams_three_choices_sharing_the_prompt(server):
    bm = server.llm.engine.block_manager
    hits = bm.prefix_hit_blocks
    prompt = " ".join(["word"] * 40)  # more than two full blocks
    stream = server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, n=3, temperature=1.0, seed=5, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts, reasons = {}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert sorted(texts) == [0, 1, 2] and set(reasons.values()) == {"length"}
    server.wait_idle()
    assert bm.prefix_hit_blocks - hits >= 2 * 2  # samples 1 and 2 reused sample 0's blocks


def test_seeded_n_is_reproducible_and_samples_differ(server):
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, n=3, temperature=1.0, seed=42)
    kwargs["extra_body"] = {"ignore_eos": True}
    first = server.client().completions.create(**kwargs)
    again = server.client().completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    chat = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=3, seed=1
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_best_of_must_equal_n(server):
    ok = server.client().completions.create(model=MODEL, prompt="Hi", n=2, best_of=2, max_tokens=2)
    assert len(ok.choices) == 2
    with pytest.raises(openai.BadRequestError, match="best_of"):
        server.client().completions.create(model=MODEL, prompt="Hi", n=1, best_of=3, max_tokens=2)


# -- sampling options ---------------------------------------------------------------------------
def test_sampling_options_equal_offline(server, reference):
    options = dict(
        presence_penalty=1.2,
        frequency_penalty=0.7,
        repetition_penalty=1.3,
        min_tokens=4,
        stop_token_ids=[13],
        logit_bias={400: 2.5, 17: -100},
    )
    expected = _offline(reference, PROMPTS[0], max_tokens=10, **options)
    result = server.client().completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=10,
        temperature=0,
        presence_penalty=1.2,
        frequency_penalty=0.7,
        logit_bias={"400": 2.5, "17": -100},
        extra_body={"repetition_penalty": 1.3, "min_tokens": 4, "stop_token_ids": [13]},
    )
    assert result.choices[0].text == expected.text
    forced = server.client().completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logit_bias={"400": 100}
    )
    assert forced.usage.completion_tokens == 3
    assert forced.choices[0].text == reference.engine.decode([400] * 3)


@pytest.mark.parametrize(
    "body",
    [
        {"presence_penalty": 3},
        {"frequency_penalty": "1"},
        {"logit_bias": {"abc": 1}},
        {"logit_bias": {"99999999": 1}},
        {"logprobs": 6},
        {"max_tokens": 0},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"response_format": {"type": "json_schema"}},
    ],
)
def test_invalid_options_are_400(server, body):
    status, answer = raw_request(
        server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **body}
    )
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored_with_one_warning(server, caplog):
    with caplog.at_level(logging.WARNING, logger="atom.entrypoints.openai_protocol"):
        status, body = raw_request(
            server,
            "POST",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2,
                "service_tier": "auto",
                "some_vendor_field": {"x": 1},
            },
        )
    assert status == 200, body
    warnings = [r for r in caplog.records if "ignored unknown request fields" in r.getMessage()]
    assert len(warnings) == 1
    assert "service_tier" in warnings[0].getMessage()
    assert "some_vendor_field" in warnings[0].getMessage()


# -- endpoints ----------------------------------------------------------------------------------
def test_tokenize_detokenize_model_and_version(server, reference):
    tokenizer = reference.tokenizer
    status, body = raw_request(server, "POST", "/tokenize", {"prompt": "Hello world"})
    assert status == 200
    assert body["tokens"] == tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    messages = [{"role": "user", "content": "Hi"}]
    status, chat = raw_request(server, "POST", "/tokenize", {"messages": messages})
    assert status == 200 and chat["tokens"] == reference.chat_prompt(messages)
    status, back = raw_request(server, "POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == "Hello world"
    assert raw_request(server, "POST", "/detokenize", {"tokens": [10**9]})[0] == 400
    model = server.client().models.retrieve(MODEL)
    assert model.id == MODEL
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("gpt-4")
    status, version = raw_request(server, "GET", "/version")
    assert status == 200 and version["version"]


def test_api_key(model_dir):
    server, stop = run_server(
        build_llm(model_dir, max_model_len=MAX_MODEL_LEN), MODEL, api_key="sesame"
    )
    try:
        status, body = raw_request(server, "GET", "/v1/models")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer nope", "Content-Type": "application/json"}
        assert raw_request(server, "POST", "/v1/completions", {"prompt": "x"}, wrong)[0] == 401
        with pytest.raises(openai.AuthenticationError):
            server.client().models.list()
        assert raw_request(server, "GET", "/health")[0] == 200
        assert raw_request(server, "GET", "/metrics")[0] == 200
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)
        result = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert result.usage.completion_tokens <= 2
        server.wait_idle()
    finally:
        stop()


def test_metrics_histograms(server):
    server.client().completions.create(
        model=MODEL, prompt="Count", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    server.wait_idle()
    text = raw_request(server, "GET", "/metrics")[1]
    samples = parse_metrics(text)
    label = f'model_name="{MODEL}"'
    for name in (
        "atom_time_to_first_token_seconds",
        "atom_inter_token_latency_seconds",
        "atom_e2e_request_latency_seconds",
        "atom_request_queue_time_seconds",
        "atom_request_prompt_tokens",
        "atom_request_generation_tokens",
    ):
        assert f"# TYPE {name} histogram" in text, name
        assert samples[f"{name}_count{{{label}}}"] >= 1, name
    assert samples[f'atom_request_generation_tokens_bucket{{le="5.0",{label}}}'] >= 1
    assert f"atom_prefix_cache_queries_total{{{label}}}" in samples
    assert f"atom_prefix_cache_hits_total{{{label}}}" in samples

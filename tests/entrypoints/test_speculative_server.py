"""The server with speculative decoding (the tiny Llama as its own draft: every draft is
accepted, so each step streams up to 5 tokens): text and stop strings equal offline plain
greedy output, /metrics counts proposals and acceptances, the flags build the Config."""

from __future__ import annotations

import argparse

import pytest

from atom.entrypoints.engine_args import add_engine_args, config_from_args
from tests.engine_support import build_llm
from tests.entrypoints.server_support import (
    MAX_MODEL_LEN,
    MODEL,
    greedy,
    parse_metrics,
    raw_request,
    run_server,
)

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def spec_server(model_dir):
    llm = build_llm(
        model_dir,
        max_model_len=MAX_MODEL_LEN,
        speculative_method="draft",
        speculative_model=model_dir,
        num_speculative_tokens=4,
    )
    server, stop = run_server(llm, MODEL)
    yield server
    stop()


@pytest.fixture(autouse=True)
def spec_idle_after_test(request):
    yield
    if "spec_server" in request.fixturenames:
        request.getfixturevalue("spec_server").wait_idle()


def test_stop_string_inside_an_accepted_run(spec_server, reference):
    [plain] = greedy(reference, PROMPT, 24, ignore_eos=True)
    text = plain.text
    stop = text[len(text) // 2 : len(text) // 2 + 4]  # mid-output: inside a run of 5 tokens
    want = text[: text.index(stop)]
    client = spec_server.client()
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert result.choices[0].text == want and result.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(chunk.choices[0].text for chunk in stream) == text


def test_metrics_count_drafts(spec_server):
    spec_server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=9, temperature=0)
    spec_server.wait_idle()
    samples = parse_metrics(raw_request(spec_server, "GET", "/metrics")[1])
    label = f'model_name="{MODEL}"'
    proposed = samples[f"atom_spec_decode_num_draft_tokens_total{{{label}}}"]
    accepted = samples[f"atom_spec_decode_num_accepted_tokens_total{{{label}}}"]
    assert proposed > 0 and accepted == proposed  # its own draft: everything accepted
    first = samples[f'atom_spec_decode_num_accepted_tokens_per_pos_total{{{label},position="0"}}']
    assert first == samples[f"atom_spec_decode_num_drafts_total{{{label}}}"]


def test_logprobs_are_a_400_with_speculation(spec_server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "logprobs": 2}
    status, answer = raw_request(spec_server, "POST", "/v1/completions", body)
    assert status == 400, answer
    assert "speculative decoding" in answer["error"]["message"]


def test_flags_build_the_speculative_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--device", "cpu", "--speculative-method", "ngram", "--num-speculative-tokens", "3"]
        + ["--ngram-min", "1", "--ngram-max", "5"]
    )
    config = config_from_args(args)
    assert (config.speculative_method, config.num_speculative_tokens) == ("ngram", 3)
    assert (config.ngram_min, config.ngram_max) == (1, 5)

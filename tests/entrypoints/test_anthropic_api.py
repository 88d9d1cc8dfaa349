"""Anthropic's Messages API through the unmodified anthropic SDK: text equals what the chat
API gives greedily for the same messages; streaming; Anthropic-shaped errors; x-api-key."""

from __future__ import annotations

import openai
import pytest

from tests.engine_support import build_llm
from tests.entrypoints.server_support import MAX_MODEL_LEN, MODEL, raw_request, run_server

anthropic = pytest.importorskip("anthropic", reason="pip install -e '.[dev]' (anthropic)")

KEY = "sesame"
# The SDK's create() no longer takes sampling fields (the API still does): sent as extras.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(model_dir):
    server, stop = run_server(build_llm(model_dir, max_model_len=MAX_MODEL_LEN), MODEL, api_key=KEY)
    yield server
    stop()


def client(server, key: str = KEY):
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def chat_text(server, messages, max_tokens, **extra) -> tuple[str, str, object]:
    """(text, finish_reason, usage) of the chat API, greedy (Bearer auth)."""
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    result = chat.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=extra
    )
    return result.choices[0].message.content, result.choices[0].finish_reason, result.usage


CHAT = [
    {"role": "system", "content": "You are a poet."},
    {"role": "user", "content": "Write about the sea."},
    {"role": "assistant", "content": "Waves."},
    {"role": "user", "content": "More, please."},
]


def anthropic_messages():
    """CHAT in Anthropic's form: system apart, content as a string and as blocks."""
    return dict(
        system=[{"type": "text", "text": "You are a poet."}],
        messages=[
            {"role": "user", "content": "Write about the sea."},
            {"role": "assistant", "content": [{"type": "text", "text": "Waves."}]},
            {"role": "user", "content": [{"type": "text", "text": "More, please."}]},
        ],
    )


def test_create_equals_chat(server):
    message = client(server).messages.create(
        model=MODEL, max_tokens=8, extra_body=GREEDY, **anthropic_messages()
    )
    text, finish, usage = chat_text(server, CHAT, 8)
    assert finish == "length"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == text
    assert message.stop_reason == "max_tokens" and message.role == "assistant"
    assert message.usage.input_tokens == usage.prompt_tokens
    assert message.usage.output_tokens == usage.completion_tokens == 8


def test_stream_equals_chat(server):
    with client(server).messages.stream(
        model=MODEL, max_tokens=8, extra_body=GREEDY, **anthropic_messages()
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    text, _, usage = chat_text(server, CHAT, 8)
    assert streamed == text == final.content[0].text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8 and final.usage.input_tokens == usage.prompt_tokens


def test_raw_stream_event_sequence(server):
    events = list(
        client(server).messages.create(
            model=MODEL, max_tokens=4, extra_body=GREEDY, stream=True, **anthropic_messages()
        )
    )
    types = [event.type for event in events]
    deltas = types.count("content_block_delta")
    assert deltas >= 1
    assert types == (
        ["message_start", "content_block_start"]
        + ["content_block_delta"] * deltas
        + ["content_block_stop", "message_delta", "message_stop"]
    )


def test_stop_sequences_equal_chat_stop(server):
    prompt = [{"role": "user", "content": "Count with me."}]
    full, _, _ = chat_text(server, prompt, 12)
    stop = full[len(full) // 2 :][:2]
    assert stop.strip(), full
    text, finish, _ = chat_text(server, prompt, 12, stop=[stop])
    assert finish == "stop"
    message = client(server).messages.create(
        model=MODEL, max_tokens=12, extra_body=GREEDY, messages=prompt, stop_sequences=[stop]
    )
    assert message.content[0].text == text
    assert message.stop_reason == "end_turn"


def test_errors_are_in_anthropics_shape(server):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client(server).messages.create(
            model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert "claude-nope" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client(server, key="wrong").messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"model": MODEL, "max_tokens": 4, "messages": []}, "messages"),
        (
            {"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
            "messages[0].role",
        ),  # fmt: skip
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "temperature": 1.5,
                "messages": [{"role": "user", "content": "hi"}],
            },
            "temperature",
        ),  # fmt: skip
        (
            {
                "model": MODEL,
                "max_tokens": MAX_MODEL_LEN,
                "messages": [{"role": "user", "content": "hi"}],
            },
            "max_tokens",
        ),  # fmt: skip
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "stop_sequences": [""],
                "messages": [{"role": "user", "content": "hi"}],
            },
            "stop_sequences",
        ),  # fmt: skip
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "tool_choice": {"type": "tool"},
                "messages": [{"role": "user", "content": "hi"}],
            },
            "tool_choice",
        ),  # fmt: skip
        ("{not json", "JSON"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, field):
    headers = {"Content-Type": "application/json", "x-api-key": KEY}
    status, answer = raw_request(server, "POST", "/v1/messages", body, headers)
    assert status == 400, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert field in answer["error"]["message"], answer

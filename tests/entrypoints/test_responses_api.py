"""OpenAI's Responses API through the unmodified openai SDK: text equals what the chat API
gives greedily for the same messages; stream events; previous_response_id and its store."""

from __future__ import annotations

import openai
import pytest

from atom.entrypoints.responses_api import ResponseStore
from tests.engine_support import build_llm
from tests.entrypoints.server_support import MAX_MODEL_LEN, MODEL, raw_request, run_server

STORE_SIZE = 3


@pytest.fixture(scope="module")
def server(model_dir):
    store = ResponseStore(size=STORE_SIZE, ttl_s=3600)
    server, stop = run_server(
        build_llm(model_dir, max_model_len=MAX_MODEL_LEN), MODEL, response_store=store
    )
    yield server
    stop()


def chat_text(server, messages, max_tokens, **extra) -> tuple[str, str, dict]:
    """(text, finish_reason, usage) of the chat API, greedy."""
    result = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=extra
    )
    return result.choices[0].message.content, result.choices[0].finish_reason, result.usage


def test_create_equals_chat(server):
    response = server.client().responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input="What is the capital of France?",
        max_output_tokens=8,
        temperature=0,
    )
    text, finish, usage = chat_text(
        server,
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        8,
    )
    assert text and response.output_text == text
    assert finish == "length"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == usage.prompt_tokens
    assert response.usage.output_tokens == usage.completion_tokens == 8
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    # stored: retrievable by id
    assert server.client().responses.retrieve(response.id).output_text == text


def test_message_items_equal_chat(server):
    items = [
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Red."}],
        },
        {"role": "user", "content": "Another one?"},
    ]
    response = server.client().responses.create(
        model=MODEL, input=items, max_output_tokens=6, temperature=0
    )
    text, _, _ = chat_text(
        server,
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Another one?"},
        ],
        6,
    )
    assert response.output_text == text


def test_stream_events_and_text(server):
    stream = server.client().responses.create(
        model=MODEL, input="Tell me a story.", max_output_tokens=8, temperature=0, stream=True
    )
    events = list(stream)
    types = [event.type for event in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    text, _, _ = chat_text(server, [{"role": "user", "content": "Tell me a story."}], 8)
    assert "".join(deltas) == text
    head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens reached, as OpenAI reports it
    ]
    assert types == head + ["response.output_text.delta"] * len(deltas) + tail
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 8
    assert events[0].response.id == final.id


def test_stream_helper_completes_at_a_stop_string(server):
    """`client.responses.stream` (the SDK's accumulating helper) until response.completed;
    a stop string (vLLM's extension) ends the text before max_output_tokens."""
    full, _, _ = chat_text(server, [{"role": "user", "content": "Count with me."}], 12)
    stop = full[len(full) // 2 :][:2]
    assert stop.strip(), full
    text, finish, _ = chat_text(
        server, [{"role": "user", "content": "Count with me."}], 12, stop=[stop]
    )
    assert finish == "stop"
    with server.client().responses.stream(
        model=MODEL,
        input="Count with me.",
        max_output_tokens=12,
        temperature=0,
        extra_body={"stop": [stop]},
    ) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert streamed == text == final.output_text
    assert final.status == "completed"


def test_previous_response_id_continues_the_conversation(server):
    client = server.client()
    first = client.responses.create(
        model=MODEL, instructions="Be kind.", input="Hi!", max_output_tokens=5, temperature=0
    )
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="And then?",
        max_output_tokens=5,
        temperature=0,
    )
    # The instructions do not carry over (OpenAI's rule); the conversation does.
    text, _, _ = chat_text(
        server,
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
        5,
    )
    assert second.output_text == text
    assert second.previous_response_id == first.id


def test_store_is_bounded_and_unknown_ids_are_refused(server):
    client = server.client()
    ids = [
        client.responses.create(model=MODEL, input=f"n{i}", max_output_tokens=1).id
        for i in range(STORE_SIZE + 1)
    ]
    # the oldest was evicted; the newest still chains
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(
            model=MODEL, input="x", previous_response_id=ids[0], max_output_tokens=1
        )
    assert caught.value.body["param"] == "previous_response_id"
    assert caught.value.body["code"] == "previous_response_not_found"
    client.responses.create(
        model=MODEL, input="x", previous_response_id=ids[-1], max_output_tokens=1
    )
    status, body = raw_request(
        server, "POST", "/v1/responses", {"input": "x", "previous_response_id": "resp_nope"}
    )
    assert status == 404 and body["error"]["param"] == "previous_response_id"
    # store=false: not kept
    unkept = client.responses.create(model=MODEL, input="x", max_output_tokens=1, store=False)
    status, body = raw_request(server, "GET", f"/v1/responses/{unkept.id}")
    assert status == 404 and body["error"]["param"] == "response_id"


def test_store_expiry(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("atom.entrypoints.responses_api.time.monotonic", lambda: now[0])
    store = ResponseStore(size=10, ttl_s=60)
    store.put("resp_a", [{"role": "user", "content": "a"}], {"id": "resp_a"})
    now[0] += 59
    assert store.get("resp_a")[0] == [{"role": "user", "content": "a"}]
    now[0] += 2
    with pytest.raises(Exception, match="expired after 60 s") as caught:
        store.get("resp_a")
    assert caught.value.param == "previous_response_id" and caught.value.status == 404
    assert len(store) == 0
    with pytest.raises(ValueError, match="responses-store-ttl"):
        ResponseStore(size=1, ttl_s=0)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "model": "other"}, "model"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    status, answer = raw_request(server, "POST", "/v1/responses", body)
    assert status == (404 if param == "model" else 400), answer
    assert answer["error"]["param"] == param, answer
    if isinstance(body["input"], list) and body["input"]:
        assert "item 0" in answer["error"]["message"], answer

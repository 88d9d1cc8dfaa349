"""Tools through the Responses API (openai SDK) and the Messages API (anthropic SDK),
unmodified, on the real SmolLM2-135M-Instruct.

SmolLM2 knows no tool format, so the calls are forced (tool_choice required / any / a
named function; xgrammar enforces them). The arguments must validate against the tool's
schema (jsonschema, independent of the server) and equal the chat API's call for the same
request; a tool result sent back gets the chat API's greedy answer to the same history.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.entrypoints.server_support import raw_request, run_server

anthropic = pytest.importorskip("anthropic", reason="pip install -e '.[dev]' (anthropic)")

SMOL = "smollm2"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
DESCRIPTION = "The current weather in a city."
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA},
}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": DESCRIPTION,
    "parameters": SCHEMA,
}
ANTHROPIC_TOOL = {"name": "get_weather", "description": DESCRIPTION, "input_schema": SCHEMA}
ASK = "What is the weather in Paris today?"


@pytest.fixture(scope="module")
def smol_server(smollm2_llm):
    server, stop = run_server(smollm2_llm, SMOL)  # the session's engine (tests/engine_support)
    yield server
    stop()


def chat_call(server, tool_choice) -> tuple[str, dict]:
    """(name, arguments) of the chat API's forced call, checked against the schema."""
    result = server.client().chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": ASK}],
        tools=[CHAT_TOOL],
        tool_choice=tool_choice,
        max_tokens=96,
        temperature=0,
    )
    assert result.choices[0].finish_reason == "tool_calls"
    (call,) = result.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMA)
    return call.function.name, arguments


def chat_answer(server, messages) -> str:
    result = server.client().chat.completions.create(
        model=SMOL, messages=messages, tools=[CHAT_TOOL], max_tokens=16, temperature=0
    )
    return result.choices[0].message.content


@pytest.mark.parametrize(
    "choice, chat_choice",
    [
        ("required", "required"),
        (
            {"type": "function", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
        ),
    ],
    ids=["required", "named"],
)
def test_responses_function_call_plain_and_streamed(smol_server, choice, chat_choice):
    expected = chat_call(smol_server, chat_choice)
    options = dict(
        model=SMOL,
        input=ASK,
        tools=[RESPONSES_TOOL],
        tool_choice=choice,
        max_output_tokens=96,
        temperature=0,
    )
    response = smol_server.client().responses.create(**options)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and response.status == "completed"
    arguments = json.loads(calls[0].arguments)
    jsonschema.validate(arguments, SCHEMA)
    assert (calls[0].name, arguments) == expected
    with smol_server.client().responses.stream(**options) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert (streamed.name, json.loads(streamed.arguments)) == expected
    types = [event.type for event in events]
    assert "response.function_call_arguments.done" in types
    assert types[-1] == "response.completed"


def test_responses_function_call_output_gets_an_answer(smol_server):
    name, arguments = chat_call(smol_server, "required")
    call = {"id": "call_1", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip
    history = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    expected = chat_answer(smol_server, history)
    response = smol_server.client().responses.create(
        model=SMOL,
        input=[
            {"role": "user", "content": ASK},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": name,
                "arguments": json.dumps(arguments),
            },  # fmt: skip
            {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees, sunny"},
        ],
        tools=[RESPONSES_TOOL],
        max_output_tokens=16,
        temperature=0,
    )
    assert expected and response.output_text == expected


def test_anthropic_tool_use_plain_and_streamed(smol_server):
    expected = chat_call(smol_server, "required")
    client = anthropic.Anthropic(base_url=smol_server.url, api_key="unused", max_retries=0)
    options = dict(
        model=SMOL,
        max_tokens=96,
        messages=[{"role": "user", "content": ASK}],
        tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    message = client.messages.create(**options)
    (block,) = [b for b in message.content if b.type == "tool_use"]
    jsonschema.validate(block.input, SCHEMA)
    assert (block.name, block.input) == expected
    assert message.stop_reason == "tool_use"
    with client.messages.stream(**options) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == expected and streamed.id == streamed.id.strip()
    assert final.stop_reason == "tool_use"
    # a named tool: the chat API's named choice (its grammar is the arguments object alone,
    # so greedy may fill it otherwise than under "required")
    expected_named = chat_call(
        smol_server, {"type": "function", "function": {"name": "get_weather"}}
    )
    named = client.messages.create(
        **{**options, "tool_choice": {"type": "tool", "name": "get_weather"}}
    )
    assert [(b.name, b.input) for b in named.content if b.type == "tool_use"] == [expected_named]


def test_anthropic_tool_result_gets_an_answer(smol_server):
    name, arguments = chat_call(smol_server, "required")
    call = {"id": "toolu_1", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip
    expected = chat_answer(
        smol_server,
        [
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18 degrees, sunny"},
        ],
    )
    client = anthropic.Anthropic(base_url=smol_server.url, api_key="unused", max_retries=0)
    message = client.messages.create(
        model=SMOL,
        max_tokens=16,
        tools=[ANTHROPIC_TOOL],
        messages=[
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": name, "input": arguments}
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": "18 degrees, sunny",
                    }
                ],
            },
        ],  # fmt: skip
        extra_body={"temperature": 0},
    )
    assert expected and message.content[0].text == expected


def test_bad_tool_input_names_the_field(smol_server):
    status, body = raw_request(
        smol_server,
        "POST",
        "/v1/responses",
        {
            "input": ASK,
            "tools": [RESPONSES_TOOL],
            "tool_choice": {"type": "function", "name": "nope"},
        },  # fmt: skip
    )
    assert status == 400 and body["error"]["param"] == "tool_choice", body
    status, body = raw_request(
        smol_server,
        "POST",
        "/v1/messages",
        {
            "model": SMOL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": ASK}],
            "tools": [ANTHROPIC_TOOL],
            "tool_choice": {"type": "tool", "name": "nope"},
        },  # fmt: skip
    )
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    assert "tool_choice" in body["error"]["message"]
    status, body = raw_request(
        smol_server,
        "POST",
        "/v1/messages",
        {
            "model": SMOL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": ASK}],
            "tools": [{**ANTHROPIC_TOOL, "input_schema": {"type": "nonsense"}}],
        },  # fmt: skip
    )
    assert status == 400 and "tools" in body["error"]["message"], body

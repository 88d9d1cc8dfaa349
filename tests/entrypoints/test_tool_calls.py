"""Tool calling in /v1/chat/completions with real clients (the openai SDK and LangChain,
unmodified) on the real SmolLM2-135M-Instruct.

SmolLM2 knows no tool format, so these force the call: tool_choice "required" or a named
function, enforced by xgrammar. Whatever the model writes, the arguments must parse and
validate against the tool's schema (checked with jsonschema, independently of the
server), and a stream must add up to the same calls as the plain answer (greedy).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.entrypoints.server_support import raw_request, run_server

SMOL = "smollm2"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 32}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris today?"}]


@pytest.fixture(scope="module")
def smol_server(smollm2_llm):
    server, stop = run_server(smollm2_llm, SMOL)  # the session's engine (tests/engine_support)
    yield server
    stop()


def _validated(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, after checking them against the tool's schema."""
    found = []
    for call in calls:
        name, arguments = call.function.name, json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[name])
        found.append((name, arguments))
    return found


def _streamed_calls(stream) -> tuple[list[dict], str | None]:
    """Calls assembled from OpenAI-format deltas, and the finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls_plain_and_streamed(smol_server, tool_choice):
    client = smol_server.client()
    options = dict(model=SMOL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=96)
    answer = client.chat.completions.create(temperature=0, **options)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = _validated(choice.message.tool_calls)
    assert calls and choice.message.content is None
    if tool_choice != "required":
        assert [name for name, _ in calls] == ["get_weather"]
    assert len({call.id for call in choice.message.tool_calls}) == len(calls)

    streamed, finish = _streamed_calls(
        client.chat.completions.create(temperature=0, stream=True, **options)
    )
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls


def test_required_without_parallel_calls_gives_one_call(smol_server):
    answer = smol_server.client().chat.completions.create(
        model=SMOL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    assert len(_validated(answer.choices[0].message.tool_calls)) == 1


def test_sampled_forced_calls_still_validate(smol_server):
    """Sampling (not greedy), several choices: every one's arguments validate."""
    answer = smol_server.client().chat.completions.create(
        model=SMOL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=128,
        temperature=1.0,
        seed=7,
        n=3,
    )
    for choice in answer.choices:
        if choice.finish_reason == "tool_calls":  # "length" may cut a long sample
            assert _validated(choice.message.tool_calls)


def test_tool_result_sent_back_gets_an_answer(smol_server, smollm2_llm):
    client = smol_server.client()
    first = client.chat.completions.create(
        model=SMOL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=96,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),  # as the SDK user sends it
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    answer = client.chat.completions.create(
        model=SMOL, messages=history, tools=TOOLS, max_tokens=24, temperature=0
    )
    choice = answer.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
    # SmolLM2's template has no tool_calls: the call goes in as JSON text, the result
    # as a "tool" turn. The prompt the server used is exactly that rendering.
    calls_text = json.dumps([{"name": "get_weather", "arguments": call.function.arguments}])
    expected = smollm2_llm.tokenizer.apply_chat_template(
        [
            *ASK,
            {"role": "assistant", "content": calls_text},
            {"role": "tool", "content": history[2]["content"]},
        ],
        add_generation_prompt=True,
        tokenize=True,
    )
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    assert answer.usage.prompt_tokens == len(expected)


def test_tool_choice_none_and_auto_without_a_parser_answer_in_text(smol_server):
    """SmolLM2's template shows no tool format, so no parser is picked: "auto" answers as
    text, like "none" (the same greedy text)."""
    client = smol_server.client()
    answers = [
        client.chat.completions.create(
            model=SMOL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=12, temperature=0
        ).choices[0]
        for choice in ("none", "auto")
    ]
    for choice in answers:
        assert choice.message.content and not choice.message.tool_calls
        assert choice.finish_reason in ("stop", "length")
    assert answers[0].message.content == answers[1].message.content


def test_langchain_bind_tools_gives_a_tool_call(smol_server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=f"{smol_server.url}/v1",
        api_key="unused",
        model=SMOL,
        max_tokens=96,
        temperature=0,
        max_retries=0,
    )
    answer = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke(ASK[0]["content"])
    assert [call["name"] for call in answer.tool_calls] == ["get_weather"]
    jsonschema.validate(answer.tool_calls[0]["args"], SCHEMAS["get_weather"])
    assert answer.tool_calls[0]["id"].startswith("call_")


# -- bad input -----------------------------------------------------------------------------
def _chat(**fields) -> dict:
    return {"model": SMOL, "messages": ASK, "max_tokens": 4, **fields}


BAD_TOOL_REQUESTS = {
    "schema not valid JSON Schema": (
        _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]),
        "tools[0].function.parameters",
    ),
    "schema with a bad keyword value": (
        _chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"required": "x"}}}]
        ),
        "tools[0].function.parameters",
    ),
    "unknown tool_choice name": (
        _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice",
    ),
    "unknown tool_choice string": (_chat(tools=TOOLS, tool_choice="always"), "tool_choice"),
    "required without tools": (_chat(tool_choice="required"), "tool_choice"),
    "tool message without tool_call_id": (
        _chat(messages=[*ASK, {"role": "tool", "content": "21 C"}]),
        "tool_call_id",
    ),
    "tool calls on a user message": (
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                }
            ]
        ),
        "tool_calls",
    ),
    "forced call with response_format": (
        _chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
        "response_format",
    ),
    "tools in /v1/completions": ({"model": SMOL, "prompt": "Hi", "tools": TOOLS}, "tools"),
}


@pytest.mark.parametrize("case", list(BAD_TOOL_REQUESTS))
def test_bad_tool_input_is_a_400_naming_the_field(smol_server, case):
    body, field = BAD_TOOL_REQUESTS[case]
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    status, answer = raw_request(smol_server, "POST", path, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error"
    assert field in error["message"] or field in (error["param"] or ""), error

"""Reasoning output and the chat template's options, through the server.

A tiny random Llama serves a template that opens `<think>` in the prompt (as
DeepSeek-R1's does) unless `enable_thinking` is false; with --reasoning-parser the answer
then starts inside the reasoning. Expected texts come from a separate engine generating
greedily from the same prompt ids (rendered here with transformers).
"""

from __future__ import annotations

import json

import pytest

from atom.entrypoints.chat_output import ChatFormat
from atom.entrypoints.openai_protocol import ChatCompletionRequest
from tests.engine_support import build_llm
from tests.entrypoints.server_support import MAX_MODEL_LEN, MODEL, greedy, raw_request, run_server

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}"
)
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def thinking_server(model_dir):
    llm = build_llm(model_dir, max_model_len=MAX_MODEL_LEN)
    llm.tokenizer.chat_template = THINK_TEMPLATE
    server, stop = run_server(llm, MODEL, reasoning_parser="deepseek_r1")
    yield server
    stop()


def _ids(tokenizer, messages, **options) -> list[int]:
    options.setdefault("add_generation_prompt", True)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **options)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _expected(reference, ids, max_tokens: int) -> str:
    return greedy(reference, [ids], max_tokens)[0].text


def test_reasoning_from_a_template_that_opens_think(thinking_server, reference):
    ids = _ids(reference.tokenizer, HELLO, chat_template=THINK_TEMPLATE)
    expected = _expected(reference, ids, 10)
    assert expected and "</think>" not in expected  # a random model never closes it
    client = thinking_server.client()
    answer = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=10, temperature=0
    )
    message = answer.choices[0].message
    assert answer.usage.prompt_tokens == len(ids)
    assert message.reasoning_content == expected and not message.content

    stream = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=10, temperature=0, stream=True
    )
    reasoning, content = "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert reasoning == expected and content == ""


def test_chat_template_kwargs_turn_thinking_off(thinking_server, reference):
    ids = _ids(reference.tokenizer, HELLO, chat_template=THINK_TEMPLATE, enable_thinking=False)
    expected = _expected(reference, ids, 10)
    status, body = raw_request(
        thinking_server,
        "POST",
        "/v1/chat/completions",
        {
            "messages": HELLO,
            "max_tokens": 10,
            "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(ids)
    message = body["choices"][0]["message"]
    assert message["content"] == expected and message["reasoning_content"] is None


def test_continue_final_message_and_no_generation_prompt(server, reference):
    messages = [*HELLO, {"role": "assistant", "content": "I am a"}]
    ids = _ids(
        reference.tokenizer, messages, add_generation_prompt=False, continue_final_message=True
    )
    expected = _expected(reference, ids, 6)
    status, body = raw_request(
        server,
        "POST",
        "/v1/chat/completions",
        {
            "messages": messages,
            "max_tokens": 6,
            "temperature": 0,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"]["content"] == expected

    plain = _ids(reference.tokenizer, HELLO, add_generation_prompt=False)
    status, body = raw_request(
        server,
        "POST",
        "/v1/chat/completions",
        {"messages": HELLO, "max_tokens": 2, "add_generation_prompt": False},
    )
    assert status == 200 and body["usage"]["prompt_tokens"] == len(plain)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt
        (
            {"continue_final_message": True, "add_generation_prompt": False},  # last is the user's
            "continue_final_message",
        ),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ],
)
def test_bad_template_options_are_400(server, fields, named):
    status, body = raw_request(
        server, "POST", "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, **fields}
    )
    assert status == 400, body
    assert named in body["error"]["message"]


def test_auto_tool_choice_uses_the_parser_the_template_shows():
    """A template that writes `<tool_call>` picks the hermes parser for tool_choice
    auto; a forced choice uses the forced-call reader; no tools, no parser."""
    template = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat_format = ChatFormat(template)
    messages = [{"role": "user", "content": "x"}]

    def output(**fields):
        request = ChatCompletionRequest.model_validate({"messages": messages, **fields})
        return chat_format.output(request, opens_reasoning=False)

    auto = output(tools=tools)
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    message = auto.message(text)
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1}
    assert output(tools=tools, tool_choice="none").message(text)["content"] == text
    assert output().message(text)["content"] == text
    named = output(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
    assert named.message('{"a": 2}')["tool_calls"][0]["function"]["arguments"] == '{"a": 2}'


# -- tool_choice "auto" read by --tool-call-parser, end to end ------------------------------
CITY_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# A random model writes a Llama-3 style call only when made to: response_format forces the
# JSON, and the server's llama3_json parser (not the forced-call path) must read it.
LLAMA3_CALL = {
    "type": "json_schema",
    "json_schema": {
        "name": "call",
        "schema": {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "parameters": CITY_TOOL["function"]["parameters"],
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def llama3_parser_server(model_dir):
    server, stop = run_server(
        build_llm(model_dir, max_model_len=MAX_MODEL_LEN), MODEL, tool_call_parser="llama3_json"
    )
    yield server
    stop()


def test_auto_tool_calls_read_by_the_server_parser(llama3_parser_server, reference):
    import jsonschema

    tokenizer = reference.tokenizer
    # JSON allows whitespace anywhere, which a random model writes forever: banned here.
    blanks = [i for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()]
    client = llama3_parser_server.client()
    options = dict(
        model=MODEL,
        messages=HELLO,
        tools=[CITY_TOOL],
        response_format=LLAMA3_CALL,
        max_tokens=48,
        temperature=0,
        logit_bias={str(i): -100 for i in blanks},
    )
    answer = client.chat.completions.create(**options)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.message.content is None
    jsonschema.validate(json.loads(call.function.arguments), CITY_TOOL["function"]["parameters"])

    pieces, names = [], []
    finish = None
    for chunk in client.chat.completions.create(stream=True, **options):
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        assert not delta.content
        for piece in delta.tool_calls or []:
            assert piece.index == 0
            names += [piece.function.name] if piece.function.name else []
            pieces.append(piece.function.arguments or "")
    assert names == ["get_weather"] and "".join(pieces) == call.function.arguments
    assert finish == "tool_calls"
    # The same request with tool_choice "none": the JSON stays text.
    plain = client.chat.completions.create(tool_choice="none", **options).choices[0]
    assert plain.message.content and not plain.message.tool_calls
    assert json.loads(plain.message.content)["name"] == "get_weather"


def test_server_flags_for_parsers():
    from atom.entrypoints.openai_server import build_parser

    args = build_parser().parse_args(
        ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    )
    assert (args.tool_call_parser, args.reasoning_parser) == ("hermes", "qwen3")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tool-call-parser", "nonsense"])
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ChatFormat(None, tool_call_parser="nonsense")


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_calls_of_a_random_model_finish_and_validate(llama3_parser_server, tool_choice):
    """Random weights write whatever the grammar allows; a forced call's JSON has no free
    whitespace, so it finishes within max_tokens and its arguments validate."""
    import jsonschema

    answer = llama3_parser_server.client().chat.completions.create(
        model=MODEL,
        messages=HELLO,
        tools=[CITY_TOOL],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY_TOOL["function"]["parameters"])

"""Tool-call and reasoning parsers on canned outputs in each model family's format.

Every case is checked twice: as a whole answer (`ChatOutput.message`) and as a stream cut
at every character and at random places (`ChatOutput.delta`): the streamed content,
reasoning, tool-call names and argument pieces must add up to the whole answer, and the
first delta of a call carries its index, id, type and name.
"""

from __future__ import annotations

import json
import random

import pytest

from atom.entrypoints.chat_output import ChatOutput
from atom.entrypoints.chat_tools import NamedCallParser, RequiredCallsParser
from atom.entrypoints.reasoning import ThinkReasoningParser, prompt_opens_reasoning
from atom.entrypoints.tool_parsers import detect_tool_parser, tool_parser

WEATHER = {"city": "Paris", "unit": "celsius"}
# Awkward text inside arguments: braces and quotes in strings, nesting, non-ASCII.
TRICKY = {
    "query": 'a "quoted" {brace} ] and \\ slash',
    "nested": {"list": [1, {"x": None}]},
    "é": "ü",
}


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def hermes(*calls, before="", after="") -> str:
    body = "".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": {_json(args)}}}\n</tool_call>\n'
        for name, args in calls
    )
    return before + body + after


def llama3(*calls, tag=True) -> str:
    body = "; ".join(f'{{"name": "{name}", "parameters": {_json(args)}}}' for name, args in calls)
    return ("<|python_tag|>" if tag else "") + body


def deepseek_v3(*calls, before="") -> str:
    body = "".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{_json(args)}\n```"
        "<｜tool▁call▁end｜>"
        for name, args in calls
    )
    return f"{before}<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def deepseek_v31(*calls) -> str:
    body = "".join(
        f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{_json(args)}<｜tool▁call▁end｜>"
        for name, args in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def dsml(*calls, before="", bar="｜", wrapper="tool_calls") -> str:
    def parameter(key, value):
        if isinstance(value, str):
            return f'<{bar}DSML{bar}parameter name="{key}" string="true">{value}</{bar}DSML{bar}parameter>\n'
        return f'<{bar}DSML{bar}parameter name="{key}" string="false">{_json(value)}</{bar}DSML{bar}parameter>\n'

    body = "".join(
        f'<{bar}DSML{bar}invoke name="{name}">\n'
        + "".join(parameter(k, v) for k, v in args.items())
        + f"</{bar}DSML{bar}invoke>\n"
        for name, args in calls
    )
    return f"{before}<{bar}DSML{bar}{wrapper}>\n{body}</{bar}DSML{bar}{wrapper}>"


# (parser, generated text, expected content, expected [(name, arguments object)])
CASES = {
    "hermes: two calls after text": (
        "hermes",
        hermes(("get_weather", WEATHER), ("search", TRICKY), before="Let me check.\n"),
        "Let me check.\n",
        [("get_weather", WEATHER), ("search", TRICKY)],
    ),
    "hermes: text only": ("hermes", "No tools <needed> here.", "No tools <needed> here.", []),
    "hermes: malformed body kept as text": (
        "hermes",
        "<tool_call>\nnot json at all\n</tool_call> then text",
        "<tool_call>\nnot json at all\n</tool_call> then text",
        [],
    ),
    "hermes: object without a name kept as text": (
        "hermes",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    "hermes: unclosed tag at the end kept as text": (
        "hermes",
        "Hi <tool_call>",
        "Hi <tool_call>",
        [],
    ),
    "llama3: two calls with python_tag": (
        "llama3_json",
        llama3(("get_weather", WEATHER), ("search", TRICKY)),
        "",
        [("get_weather", WEATHER), ("search", TRICKY)],
    ),
    "llama3: one call without the tag": (
        "llama3_json",
        llama3(("get_weather", WEATHER), tag=False),
        "",
        [("get_weather", WEATHER)],
    ),
    "llama3: plain answer": ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    "llama3: JSON that is not a call kept as text": (
        "llama3_json",
        '{"answer": {"name": 1}}',
        '{"answer": {"name": 1}}',
        [],
    ),
    "deepseek_v3: two calls after text": (
        "deepseek_v3",
        deepseek_v3(("get_weather", WEATHER), ("search", TRICKY), before="Checking."),
        "Checking.",
        [("get_weather", WEATHER), ("search", TRICKY)],
    ),
    "deepseek_v31: two calls": (
        "deepseek_v3",
        deepseek_v31(("get_weather", WEATHER), ("search", TRICKY)),
        "",
        [("get_weather", WEATHER), ("search", TRICKY)],
    ),
    "deepseek_v3: malformed call kept as text": (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>no separator here",
        "<｜tool▁call▁begin｜>no separator here",
        [],
    ),
    "deepseek_v4: two calls after text": (
        "deepseek_v4",
        dsml(
            ("get_weather", {"city": "Paris", "days": 3}),
            ("search", {"q": "x", "n": [1, 2]}),
            before="Ok.\n\n",
        ),
        "Ok.\n\n",
        [("get_weather", {"city": "Paris", "days": 3}), ("search", {"q": "x", "n": [1, 2]})],
    ),
    "deepseek_v32: ASCII bars, function_calls wrapper": (
        "deepseek_v4",
        dsml(("get_weather", {"city": "Rome"}), bar="|", wrapper="function_calls"),
        "",
        [("get_weather", {"city": "Rome"})],
    ),
    "deepseek_v4: invoke without a name kept as text": (
        "deepseek_v4",
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke>oops",
        "<｜DSML｜invoke>oops",
        [],
    ),
}


def _stream(output: ChatOutput, text: str, cuts: list[int]) -> tuple[str, str, list[dict]]:
    """Feed `text` cut at `cuts`; (content, reasoning, calls as {id, name, arguments})."""
    content, reasoning, calls = "", "", []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        delta = output.delta(text[start:end], final=end == len(text))
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for piece in delta.get("tool_calls", []):
            if piece["index"] == len(calls):  # a call's first delta: everything but arguments
                assert piece["type"] == "function" and piece["id"].startswith("call_")
                assert piece["function"]["name"]
                calls.append(
                    {"id": piece["id"], "name": piece["function"]["name"], "arguments": ""}
                )
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {
                    "arguments"
                }
            calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    return content, reasoning, calls


def _check_streams(make_output, text: str, message: dict) -> None:
    """Every single cut, and 20 random multi-cut splits, add up to `message`."""
    rng = random.Random(0)
    splits = [[i] for i in range(1, len(text))]
    splits += [rng.sample(range(1, len(text)), min(len(text) - 1, 12)) for _ in range(20)]
    splits.append(list(range(1, len(text))))  # one character at a time
    expected_calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    for cuts in splits:
        content, reasoning, calls = _stream(make_output(), text, cuts)
        if expected_calls:  # the message leaves out content that is only whitespace
            assert content.strip() == (message["content"] or "").strip(), cuts
        else:
            assert content == message["content"], cuts
        assert reasoning == (message.get("reasoning_content") or ""), cuts
        assert [(c["name"], c["arguments"]) for c in calls] == expected_calls, cuts


@pytest.mark.parametrize("case", list(CASES))
def test_parser_whole_and_streamed(case):
    name, text, content, expected = CASES[case]
    message = ChatOutput(tool_parser(name)).message(text)
    calls = message.get("tool_calls", [])
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ] == expected
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    if expected:
        assert message["content"] == (content.strip() or None)
    else:
        assert message["content"] == content
    _check_streams(lambda: ChatOutput(tool_parser(name)), text, message)


def test_finish_reason_is_tool_calls_only_after_calls():
    output = ChatOutput(tool_parser("hermes"))
    output.message(hermes(("f", {})))
    assert output.finish_reason("stop") == "tool_calls"
    assert output.finish_reason("length") == "length"
    plain = ChatOutput(tool_parser("hermes"))
    plain.message("hello")
    assert plain.finish_reason("stop") == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = hermes(("a", {"x": 1}), ("b", {}))
    message = ChatOutput(tool_parser("hermes"), parallel_tool_calls=False).message(text)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a"]


def test_arguments_cut_by_max_tokens_stay_a_call():
    """Output cut inside the arguments (finish_reason length): the call and what was
    written of its arguments, as OpenAI returns a cut answer."""
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Par'
    message = ChatOutput(tool_parser("hermes")).message(text)
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"city": "Par'}


def test_forced_named_and_required_outputs():
    named = ChatOutput(NamedCallParser("get_weather"))
    text = '  {"city": "Paris", "unit": "celsius"}'
    message = named.message(text)
    assert message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == WEATHER
    _check_streams(lambda: ChatOutput(NamedCallParser("get_weather")), text, message)
    required = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "s", "parameters": {}}]'
    message = ChatOutput(RequiredCallsParser()).message(required)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}'),
        ("s", "{}"),
    ]
    _check_streams(lambda: ChatOutput(RequiredCallsParser()), required, message)


# -- reasoning ------------------------------------------------------------------------------
REASONING_CASES = {
    "think then answer": (
        "<think>\nLet me see.\n</think>\n\nParis.",
        False,
        "\nLet me see.\n",
        "Paris.",
    ),
    "prompt opened think": (
        "First, 2+2.</think>The answer is 4.",
        True,
        "First, 2+2.",
        "The answer is 4.",
    ),
    "no think at all": ("Just an answer.", False, None, "Just an answer."),
    "cut inside the reasoning": ("<think>still thinking", False, "still thinking", ""),
    "a < that is not a tag": ("<thinking aloud> is fine", False, None, "<thinking aloud> is fine"),
}


@pytest.mark.parametrize("case", list(REASONING_CASES))
def test_reasoning_whole_and_streamed(case):
    text, inside, reasoning, content = REASONING_CASES[case]

    def make():
        return ChatOutput(reasoning=ThinkReasoningParser(), starts_in_reasoning=inside)

    message = make().message(text)
    assert message["reasoning_content"] == reasoning and message["content"] == content
    _check_streams(make, text, message)


def test_reasoning_then_tool_call():
    text = "<think>I should call it.</think>\n" + hermes(("get_weather", WEATHER))
    make = lambda: ChatOutput(tool_parser("hermes"), ThinkReasoningParser())  # noqa: E731
    message = make().message(text)
    assert message["reasoning_content"] == "I should call it."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == WEATHER
    _check_streams(make, text, message)


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|Assistant|><think>\n")
    assert not prompt_opens_reasoning("<|Assistant|><think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_parser_detected_from_the_chat_template():
    assert (
        detect_tool_parser("{% for tool in tools %}<tool_call>{{ tool }}</tool_call>") == "hermes"
    )
    assert detect_tool_parser("{{'<｜tool▁calls▁begin｜>'}}") == "deepseek_v3"
    assert detect_tool_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_tool_parser("<|im_start|>{{ message['content'] }}") is None
    assert detect_tool_parser("<tool_call> <|python_tag|>") is None  # ambiguous: none
    assert detect_tool_parser(None) is None

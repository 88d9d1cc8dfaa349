"""Structured output (response_format) on the real SmolLM2-135M-Instruct, through the
official client: every answer parses as JSON and validates against its schema."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tests.entrypoints.server_support import run_server

SMOL = "smollm2"

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "colors": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "answer": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "is_capital": {"type": "boolean"},
        },
        "required": ["city", "is_capital"],
        "additionalProperties": False,
    },
}
QUESTIONS = {
    "person": "Invent a person. Answer in JSON with name and age.",
    "colors": "List some colors of the French flag in JSON.",
    "answer": "What is the capital of France? Answer in JSON.",
}


@pytest.fixture(scope="module")
def smol_server(smollm2_llm):
    server, stop = run_server(smollm2_llm, SMOL)  # the session's engine (tests/engine_support)
    yield server
    stop()


@pytest.fixture(autouse=True)
def smol_idle(request):
    yield
    if "smol_server" in request.fixturenames:
        request.getfixturevalue("smol_server").wait_idle()


def _ask(client, question, response_format, max_tokens=60):
    return client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        response_format=response_format,
    )


def test_json_schemas_parse_and_validate(smol_server):
    client = smol_server.client()
    for name, schema in SCHEMAS.items():
        format_ = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        result = _ask(client, QUESTIONS[name], format_)
        choice = result.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_batched_with_an_unconstrained_request(smol_server):
    client = smol_server.async_client()

    async def both():
        constrained = client.chat.completions.create(
            model=SMOL,
            messages=[{"role": "user", "content": "Describe a cat as JSON."}],
            max_tokens=48,
            temperature=0,
            response_format={"type": "json_object"},
        )
        free = client.chat.completions.create(
            model=SMOL,
            messages=[{"role": "user", "content": "Describe a cat."}],
            max_tokens=8,
            temperature=0,
        )
        return await asyncio.gather(constrained, free)

    constrained, free = asyncio.run(both())
    text = constrained.choices[0].message.content
    if constrained.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a JSON object's prefix
        assert text.lstrip().startswith("{")
    assert free.choices[0].message.content and not free.choices[0].message.content.startswith("{")


def test_invalid_schema_is_a_400(smol_server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        _ask(smol_server.client(), "Hi", bad)

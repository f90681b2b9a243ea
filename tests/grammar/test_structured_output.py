"""Structured output and tool calling against the real server and the embedded model (CPU), through
the official `openai` client: JSON schemas and json_object hold while sampling (greedy and sampled,
streamed and not), forced tool choices yield calls whose arguments fit the function's schema, and
bad schemas and tool specs are 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from test_server import ServerProcess, openai_client, served

# Against a real server with the embedded model: about 2-4 minutes on the 2-core box, so in
# `make test-slow`; tests/grammar/test_grammar_tools.py covers masks, parsers and streamed deltas in `make test`.
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
COLORS = {
    "type": "array",
    "items": {"type": "string", "enum": ["red", "green", "blue"]},
    "minItems": 2,
    "maxItems": 4,
}
FLAG = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
    "required": ["ok", "score"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from served("--max-seq-len", "1024", "--served-model-name", "smol")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai_client(server)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", [PERSON, COLORS, FLAG], ids=["object", "array", "boolean-number"])
def test_json_schema_output_is_valid(client, schema: dict) -> None:
    messages = [{"role": "user", "content": "Give me an example as JSON."}]
    r = client.chat.completions.create(
        model="smol",
        messages=messages,
        max_tokens=100,
        temperature=1.0,
        seed=7,
        n=2,
        response_format=_schema_format(schema),
    )
    for c in r.choices:  # sampled (greedy: the streamed test below)
        assert c.finish_reason == "stop", c.message.content  # ended by the grammar, not the budget
        jsonschema.validate(json.loads(c.message.content), schema)


def test_json_schema_streamed(client) -> None:
    kw = dict(
        model="smol",
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=120,
        temperature=0,
        response_format=_schema_format(PERSON),
    )
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_and_completions(client, server: ServerProcess) -> None:
    r = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Tell me a joke."}],  # nothing asks for JSON but the grammar
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    # /v1/completions takes response_format too (vLLM's extension), here over plain HTTP
    body = {"model": "smol", "prompt": "A list of colors:", "max_tokens": 60, "temperature": 0}
    body["response_format"] = _schema_format(COLORS)
    text = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    jsonschema.validate(json.loads(text), COLORS)


def test_without_a_grammar_the_output_is_not_held(client) -> None:
    """The control: the same request without response_format is not JSON (so the tests above test
    the grammar, not the model's habits)."""
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Tell me a joke."}], max_tokens=8, temperature=0
    )
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


def test_named_tool_choice_gives_a_valid_call(client) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(
        model="smol", messages=ASK, max_tokens=60, temperature=0, tools=[WEATHER, TIME], tool_choice=choice
    )
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    [call] = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # streamed: the name first, then the arguments in pieces that add up to the same call
    pieces: dict[str, str] = {"name": "", "arguments": ""}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                assert d.index == 0
                pieces["name"] += d.function.name or ""
                pieces["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert pieces == {"name": "get_weather", "arguments": call.function.arguments}
    assert finish == "tool_calls"


def test_required_tool_choice_gives_calls(client) -> None:
    kw = dict(model="smol", messages=ASK, max_tokens=100, temperature=0, tools=[WEATHER, TIME])
    r = client.chat.completions.create(**kw, tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert len(calls) >= 1
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for call in calls:
        jsonschema.validate(
            json.loads(call.function.arguments), tools[call.function.name]["function"]["parameters"]
        )


def test_tool_history_is_rendered(client, server: ServerProcess) -> None:
    """An assistant's tool call and the tool's answer in the history reach the model (SmolLM2's
    template has no tool support: Hermes-style text in the prompt)."""
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]
    r = client.chat.completions.create(
        model="smol", messages=history, max_tokens=4, temperature=0, tools=[WEATHER], tool_choice="none"
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    short = client.chat.completions.create(model="smol", messages=ASK, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens > short.usage.prompt_tokens + 20  # the call and the result are in it


def test_legacy_functions(client) -> None:
    r = client.chat.completions.create(
        model="smol",
        messages=ASK,
        max_tokens=60,
        temperature=0,
        functions=[WEATHER["function"]],
        function_call={"name": "get_weather"},
    )
    c = r.choices[0]
    assert c.finish_reason == "function_call" and c.message.function_call.name == "get_weather"
    jsonschema.validate(json.loads(c.message.function_call.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"response_format": _schema_format({"type": "nonsense"})}, "nonsense"),
        ({"response_format": _schema_format({"type": "string", "pattern": "("})}, "regex"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "name"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tools": [WEATHER, WEATHER]}, "unique"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "combined",
        ),
    ],
)
def test_bad_schemas_and_tool_specs_are_400(server: ServerProcess, extra: dict, words: str) -> None:
    body = {"model": "smol", "messages": ASK, "max_tokens": 5, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.text

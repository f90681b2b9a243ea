"""What the HTTP layer does with grammars, against fake workers and as units: schemas checked for
size and shape only (no compile on the event loop), the grammar built for exactly the field and
tool the request names, reserved-looking function names forced like any other, `$defs` under
"required", the smaller refusals (tool results that answer no call, text.format without a schema,
logit_bias given as strings), a grammar refusal named by field whether streamed or not, an output
that fails after some text, and short error texts."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import test_api_app
from test_api_app import anyio_backend, assert_openai_error, chat_body, sse_events  # noqa: F401
from test_responses import events_of, sent

from minisgl.entrypoints.openai.tools import ToolOutput, named_grammar, required_schema
from minisgl.grammar import (
    GRAMMAR_REFUSED,
    GrammarError,
    SchemaLimits,
    check_grammar,
    check_schema,
    json_schema_grammar,
    short_error,
)
from minisgl.message import UserReply

api = test_api_app.api

UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}


def _tool(name: str, params: dict | None = None) -> dict:
    params = params or {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    return {"type": "function", "function": {"name": name, "parameters": params}}


def _optional_props(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


# ---- the event loop never compiles ----------------------------------------------------------------


@pytest.mark.anyio
async def test_a_huge_schema_is_refused_at_once_naming_the_field(api) -> None:
    """The finding's 0.93 MiB request (2 tools of 16,000 optional properties) froze the server for
    15.8 s; now its size alone refuses it, in about the time a small request takes to parse."""
    huge = _optional_props(16_000)
    body = chat_body(tools=[_tool("a", huge), _tool("b", huge)])
    t0 = time.perf_counter()
    r = await api.post("/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - t0
    err = assert_openai_error(r, 400)
    assert "too large" in err["message"] and err["param"].startswith("tools")
    t0 = time.perf_counter()
    await api.post("/v1/chat/completions", json=body)  # the same again: a second calibration point
    assert elapsed < 20 * max(time.perf_counter() - t0, 0.05)  # no seconds-long compile hides in it


@pytest.mark.anyio
async def test_no_grammar_is_compiled_while_validating(api, monkeypatch) -> None:
    """A schema the HTTP layer passes reaches the workers as grammar text, never compiled here."""
    import llguidance

    real = llguidance.LLMatcher

    class TextOnly:  # makes grammar text; compiling or validating fails the test
        grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)

        def __init__(self, *_a: object, **_k: object) -> None:
            raise AssertionError("a grammar was compiled on the API server")

        @staticmethod
        def validate_grammar(*_a: object, **_k: object) -> str:
            raise AssertionError("a grammar was validated on the API server")

    monkeypatch.setattr(llguidance, "LLMatcher", TextOnly)
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": _optional_props(3000)}}
    r = await api.post("/v1/chat/completions", json=chat_body(response_format=fmt))
    assert r.status_code == 200, r.text
    assert sent(api).sampling_params.grammar == json_schema_grammar(_optional_props(3000), check=False)


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "nonsense"}, "invalid type"),
        ({"type": 3}, "invalid type"),
        ({"type": "object", "properties": []}, "properties must be an object"),
        ({"anyOf": {"type": "string"}}, "anyOf must be a list"),
        ({"type": "object", "required": "x"}, "required must be a list"),
        ({"type": "string", "pattern": 5}, "pattern must be a string"),
        (7, "must be a JSON object or a boolean"),
        ({"items": {"items": {"items": {"items": {}}}}}, "nests too deeply"),
    ],
)
def test_check_schema_refuses_bad_shapes(schema: object, words: str) -> None:
    with pytest.raises(GrammarError, match=words):
        check_schema(schema, SchemaLimits(max_depth=3))


def test_check_schema_limits_size_and_parts() -> None:
    with pytest.raises(GrammarError, match="too large"):
        check_schema(_optional_props(100), SchemaLimits(max_bytes=500))
    with pytest.raises(GrammarError, match="too many parts"):
        check_schema(_optional_props(100), SchemaLimits(max_nodes=50))
    check_schema(_optional_props(100))
    check_schema(True)


# ---- the grammar is the named one ----------------------------------------------------------------


@pytest.mark.anyio
async def test_a_named_tool_gets_its_own_grammar_not_the_first_tools(api) -> None:
    first, second = _tool("first"), _tool("second", {"type": "object", "properties": {"y": UNIT}})
    choice = {"type": "function", "function": {"name": "second"}}
    r = await api.post("/v1/chat/completions", json=chat_body(tools=[first, second], tool_choice=choice))
    assert r.status_code == 200, r.text
    assert sent(api).sampling_params.grammar == named_grammar(second)
    assert sent(api).sampling_params.grammar != named_grammar(first)


@pytest.mark.anyio
async def test_text_format_gives_the_schemas_grammar(api) -> None:
    schema = {"type": "object", "properties": {"city": UNIT}, "required": ["city"]}
    fmt = {"type": "json_schema", "name": "o", "schema": schema}
    r = await api.post("/v1/responses", json={"input": "x", "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    assert sent(api).sampling_params.grammar == json_schema_grammar(schema, check=False)


@pytest.mark.parametrize("name", ["auto", "none", "required"])
@pytest.mark.anyio
async def test_functions_named_like_modes_are_forced_by_name(api, name: str) -> None:
    tools = [_tool("other"), _tool(name)]
    expected = named_grammar(tools[1])
    forms = [
        chat_body(tools=tools, tool_choice={"type": "function", "function": {"name": name}}),
        chat_body(functions=[t["function"] for t in tools], function_call={"name": name}),
    ]
    for body in forms:
        r = await api.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        msg = sent(api)
        assert msg.sampling_params.grammar == expected, body
        assert name in msg.tools or name in json.dumps(msg.text)  # the tools stay in the prompt
        answer = r.json()["choices"][0]["message"]
        call = answer["tool_calls"][0] if "tool_calls" in answer else answer["function_call"]
        assert (call.get("function") or call)["name"] == name
    responses_tools = [{"type": "function", **t["function"]} for t in tools]
    r = await api.post(
        "/v1/responses",
        json={"input": "x", "tools": responses_tools, "tool_choice": {"type": "function", "name": name}},
    )
    assert r.status_code == 200, r.text
    assert sent(api).sampling_params.grammar == expected
    assert r.json()["output"][0]["name"] == name


# ---- "required" and $defs ------------------------------------------------------------------------


PYDANTIC_PARAMS = {  # as pydantic writes a model with a nested enum
    "$defs": {"Unit": UNIT},
    "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"],
    "type": "object",
}


@pytest.mark.parametrize("others", [0, 1])
def test_required_keeps_each_tools_defs_resolvable(others: int) -> None:
    tools = [_tool("plain")] * others + [_tool("weather", PYDANTIC_PARAMS)]
    check_grammar(json_schema_grammar(required_schema(tools), check=False))  # compiles: no bad pointer


@pytest.mark.anyio
async def test_required_with_defs_is_accepted(api) -> None:
    body = chat_body(tools=[_tool("weather", PYDANTIC_PARAMS), _tool("t")], tool_choice="required")
    r = await api.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    check_grammar(sent(api).sampling_params.grammar)


def test_a_cut_required_answer_keeps_its_text() -> None:
    out = ToolOutput("required")
    assert out.feed('[{"name": "f", "param') == []
    deltas, reason = out.finish("length")
    assert deltas == [{"content": '[{"name": "f", "param'}] and reason == "length"
    assert out.content == '[{"name": "f", "param' and out.calls == []


# ---- the smaller refusals -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_tool_result_must_answer_a_call(api) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "t", "arguments": "{}"}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_2", "content": "x"},
    ]
    err = assert_openai_error(await api.post("/v1/chat/completions", json={"messages": history}), 400)
    assert "messages[2].tool_call_id" in err["message"] and "call_2" in err["message"]
    history[2]["tool_call_id"] = "call_1"
    assert (await api.post("/v1/chat/completions", json={"messages": history})).status_code == 200


@pytest.mark.anyio
async def test_a_function_call_output_must_answer_a_call(api) -> None:
    items = [
        {"type": "function_call", "call_id": "c1", "name": "t", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c9", "output": "x"},
    ]
    err = assert_openai_error(await api.post("/v1/responses", json={"input": items}), 400)
    assert "input[1].call_id" in err["message"]
    items[1]["call_id"] = "c1"
    assert (await api.post("/v1/responses", json={"input": items})).status_code == 200


@pytest.mark.anyio
async def test_text_format_json_schema_needs_a_schema(api) -> None:
    body = {"input": "x", "text": {"format": {"type": "json_schema", "name": "o"}}}
    err = assert_openai_error(await api.post("/v1/responses", json=body), 400)
    assert "needs a schema" in err["message"]


@pytest.mark.anyio
async def test_logit_bias_values_must_be_numbers(api) -> None:
    for value in ("5", True, None):
        r = await api.post("/v1/completions", json={"prompt": "x", "logit_bias": {"1": value}})
        assert_openai_error(r, 400, "logit_bias.1")
    r = await api.post("/v1/completions", json={"prompt": "x", "logit_bias": {"1": 5, "2": -1.5}})
    assert r.status_code == 200
    assert sent(api).sampling_params.logit_bias == {1: 5.0, 2: -1.5}


# ---- refusals and failures from the scheduler -----------------------------------------------------


REFUSAL = f"{GRAMMAR_REFUSED}: Invalid type: nonsense"


async def _refuse_first_grammar(api, after_tokens: int = 0) -> None:
    """End the one request in flight with a grammar error from the scheduler: before any output
    (the request's prompt must hold SILENT: the test acknowledges it itself), or after the fake
    workers sent `after_tokens` tokens."""
    while not api.state.manager.streams or not all(
        s.completion_tokens >= after_tokens for s in api.state.manager.streams.values()
    ):
        await asyncio.sleep(0.005)
    [stream] = api.state.manager.streams.values()
    if not after_tokens:
        stream.push(UserReply(stream.uid, "", False, prompt_tokens=1))
    stream.push(UserReply(stream.uid, "", True, "error", completion_tokens=after_tokens, error=REFUSAL))


FMT = {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.anyio
async def test_a_refused_grammar_is_a_400_naming_the_field_streamed_or_not(api, stream: bool) -> None:
    body = chat_body("SILENT", response_format=FMT, stream=stream)
    task = asyncio.create_task(api.post("/v1/chat/completions", json=body))
    await _refuse_first_grammar(api)
    err = assert_openai_error(await task, 400, "response_format")
    assert err["message"] == REFUSAL
    body = {
        "input": "SILENT",
        "stream": stream,
        "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}},
    }
    task = asyncio.create_task(api.post("/v1/responses", json=body))
    await _refuse_first_grammar(api)
    assert_openai_error(await task, 400, "text.format")


@pytest.mark.anyio
async def test_a_grammar_failing_after_output_ends_with_error(api) -> None:
    body = chat_body("FOREVER", response_format=FMT, stream=True)
    task = asyncio.create_task(api.post("/v1/chat/completions", json=body))
    await _refuse_first_grammar(api, after_tokens=2)
    r = await task
    assert r.status_code == 200
    events = sse_events(r.text)
    *chunks, error = events
    assert chunks[-1]["choices"][0]["finish_reason"] == "error"
    assert error["error"] == {
        "message": REFUSAL,
        "type": "invalid_request_error",
        "param": "response_format",
        "code": 400,
    }
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)  # what came first stays
    # not streamed: the choice says "error" and keeps its text
    task = asyncio.create_task(api.post("/v1/chat/completions", json={**body, "stream": False}))
    await _refuse_first_grammar(api, after_tokens=2)
    r = await task
    assert r.status_code == 200
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "error" and choice["message"]["content"]
    # the Responses API: status failed, with the error
    fmt = {"type": "json_schema", "name": "o", "schema": {"type": "object"}}
    task = asyncio.create_task(api.post("/v1/responses", json={"input": "FOREVER", "text": {"format": fmt}}))
    await _refuse_first_grammar(api, after_tokens=2)
    out = (await task).json()
    assert out["status"] == "failed" and out["error"] == {"code": "invalid_request_error", "message": REFUSAL}
    task = asyncio.create_task(
        api.post("/v1/responses", json={"input": "FOREVER", "text": {"format": fmt}, "stream": True})
    )
    await _refuse_first_grammar(api, after_tokens=2)
    events = events_of((await task).text)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["param"] == "text.format" and events[-2]["code"] == "invalid_request_error"


def test_error_texts_are_short_and_free_of_internals() -> None:
    panic = (
        "panicked at /root/.cargo/registry/src/index.crates.io-6f17d22bba15001f/derivre-0.3.8/src/ast.rs:"
        "412:9:\nassertion failed: x < y\nstack backtrace:\n" + "   0: 0x7f00 - std::backtrace\n" * 80
    )
    text = short_error(panic)
    assert len(text) <= 300 and "backtrace" not in text and "\n" not in text and ".cargo" not in text
    verbose = "Parser Error: Current row has 2407 items; max is 2000\n<state>\nTokens: {\n" + "x" * 3000
    assert short_error(verbose) == "Parser Error: Current row has 2407 items; max is 2000"
    assert len(short_error("e" * 5000)) == 300

"""OpenAI's Responses API (`POST /v1/responses`).

Against the in-process app with fake workers (fast; see test_api_app: the fake answers "echo: " and
the words of the prompt's message contents, one reply per word): the mapping onto chat messages and
sampling parameters, the response object, the streamed events as the openai SDK's stream helper
takes them, tools, incomplete answers, mid-stream errors, disconnects, and the refused fields.
Against the real server with the embedded model (CPU) through the openai client unchanged: text
streamed and not, max_output_tokens, a JSON schema, a named tool choice, a tool result in the input.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
import test_api_app
from test_api_app import anyio_backend, assert_openai_error  # noqa: F401 (a fixture)
from test_server import ServerProcess, openai_client, served

from minisgl.entrypoints.openai.responses.output import ResponseBuilder, response_usage
from minisgl.entrypoints.openai.tools import ToolFormat, ToolOutput
from minisgl.frontend.chunk import Chunk
from minisgl.message import UserReply

pytestmark = [pytest.mark.timeout(60)]
api = test_api_app.api  # the in-process app fixture

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees, sunny"},
]


def sdk(api: httpx.AsyncClient) -> Any:
    """The openai package's async client on the in-process app."""
    from openai import AsyncOpenAI

    http = httpx.AsyncClient(transport=api._transport, base_url="http://test/v1")
    return AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)


def events_of(text: str) -> list[dict]:
    """The events of a Responses stream: `event: <type>` then `data: <json>`, no [DONE]."""
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def sent(api: httpx.AsyncClient) -> Any:
    return api.workers.received[-1]


# ---- against fake workers -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_text_response_object_and_usage(api) -> None:
    r = await api.post(
        "/v1/responses", json={"model": "smol", "input": "hello there", "metadata": {"k": "v"}}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["status"] == "completed"
    assert body["model"] == "smol" and body["metadata"] == {"k": "v"} and body["incomplete_details"] is None
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "echo: hello there ", "annotations": []}]
    assert body["usage"] == {
        "input_tokens": 2,
        "input_tokens_details": {"cached_tokens": 1},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 5,
        "prompt_tokens": 2,  # SGLang's names
        "completion_tokens": 3,
    }
    assert sent(api).text == [{"role": "user", "content": "hello there"}]
    params = sent(api).sampling_params
    assert (params.temperature, params.top_p, params.grammar, params.logprobs) == (1.0, 1.0, None, None)


@pytest.mark.anyio
async def test_sdk_create_and_stream_helper(api) -> None:
    client = sdk(api)
    r = await client.responses.create(model="smol", input="a b", instructions="be brief", temperature=0.5)
    assert r.output_text == "echo: be brief a b " and r.instructions == "be brief"
    assert sent(api).text[0] == {"role": "system", "content": "be brief"}
    assert sent(api).sampling_params.temperature == 0.5
    async with client.responses.stream(model="smol", input="one two three") as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert deltas and "".join(deltas) == final.output_text == "echo: one two three "
    assert final.status == "completed" and final.usage.output_tokens == 4


@pytest.mark.anyio
async def test_stream_event_sequence(api) -> None:
    r = await api.post("/v1/responses", json={"input": "x y", "stream": True})
    events = events_of(r.text)
    kinds = [e["type"] for e in events]
    n = kinds.count("response.output_text.delta")
    assert n >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2])
    assert events[-3]["part"]["text"] == "echo: x y " == events[-4]["text"]
    final = events[-1]["response"]
    assert final["id"] == events[0]["response"]["id"] and final["output"] == [events[-2]["item"]]
    assert final["usage"]["output_tokens"] == 3


@pytest.mark.anyio
async def test_max_output_tokens_gives_incomplete(api) -> None:
    body = {"input": "a b c d e", "max_output_tokens": 2}
    r = (await api.post("/v1/responses", json=body)).json()
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete" and r["max_output_tokens"] == 2
    assert sent(api).sampling_params.max_tokens == 2
    events = events_of((await api.post("/v1/responses", json={**body, "stream": True})).text)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.anyio
async def test_input_items_become_chat_messages(api) -> None:
    api.state.tools = ToolFormat("hermes", in_template=True)  # the messages reach the template as given
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be kind"}]},
        *HISTORY,
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "It is ", "annotations": []},
                {"type": "output_text", "text": "sunny."},
            ],
        },
        {"role": "user", "content": "thanks"},
    ]
    r = await api.post("/v1/responses", json={"input": items, "tools": [WEATHER], "tool_choice": "none"})
    assert r.status_code == 200, r.text
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert sent(api).text == [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": json.dumps([call])},
        {"role": "tool", "content": "21 degrees, sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "thanks"},
    ]
    assert sent(api).tools == ""  # tool_choice none: no tools in the prompt


@pytest.mark.anyio
async def test_tool_history_without_template_support_is_hermes_text(api) -> None:
    r = await api.post("/v1/responses", json={"input": HISTORY, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    system, *turns = sent(api).text
    assert system["role"] == "system" and '"name": "get_weather"' in system["content"]
    assert "<tool_call>" in turns[1]["content"] and '"city": "Paris"' in turns[1]["content"]
    assert turns[2] == {"role": "user", "content": "<tool_response>\n21 degrees, sunny\n</tool_response>"}


@pytest.mark.anyio
async def test_auto_tool_call_is_a_function_call_item(api) -> None:
    api.state.tools = ToolFormat("hermes", in_template=True)
    said = 'look <tool_call>{"name":"get_weather","arguments":{"city":"Rome","unit":"celsius"}}</tool_call>'
    body = {"input": said, "tools": [WEATHER]}
    r = (await api.post("/v1/responses", json=body)).json()
    message, call = r["output"]
    assert message["content"][0]["text"] == "echo: look "
    assert (
        call["type"] == "function_call"
        and call["name"] == "get_weather"
        and call["call_id"].startswith("call_")
    )
    assert json.loads(call["arguments"]) == {"city": "Rome", "unit": "celsius"}
    assert r["tools"] == [WEATHER] and r["tool_choice"] == "auto"
    async with sdk(api).responses.stream(model="smol", input=said, tools=[WEATHER]) as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_response()
    assert kinds[-6:] == [
        "response.output_item.done",  # the message, done before the call is added
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert json.loads(final.output[1].arguments) == {"city": "Rome", "unit": "celsius"}


@pytest.mark.anyio
async def test_named_tool_choice_streams_the_arguments(api) -> None:
    api.state.tools = ToolFormat("hermes", in_template=True)
    body = {"input": "p q r", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}
    r = (await api.post("/v1/responses", json=body)).json()
    [call] = r["output"]  # the fake's text is the arguments (the real grammar makes them JSON)
    assert call["name"] == "get_weather" and call["arguments"] == "echo: p q r "
    assert sent(api).sampling_params.grammar is not None
    events = events_of((await api.post("/v1/responses", json={**body, "stream": True})).text)
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert "".join(deltas) == done["arguments"] == "echo: p q r "
    assert events[2]["item"]["arguments"] == "" and events[2]["item"]["name"] == "get_weather"


@pytest.mark.anyio
async def test_text_formats_and_logprobs_reach_the_sampler(api) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "out", "schema": schema, "strict": True}
    r = (await api.post("/v1/responses", json={"input": "x", "text": {"format": fmt}})).json()
    assert r["text"] == {"format": fmt}
    grammar = sent(api).sampling_params.grammar
    assert grammar is not None
    await api.post("/v1/responses", json={"input": "x", "text": {"format": {"type": "json_object"}}})
    assert sent(api).sampling_params.grammar not in (None, grammar)
    await api.post("/v1/responses", json={"input": "x", "text": {"format": {"type": "text"}}})
    assert sent(api).sampling_params.grammar is None
    body = {"input": "x", "top_logprobs": 3, "include": ["message.output_text.logprobs"]}
    r = (await api.post("/v1/responses", json=body)).json()
    assert sent(api).sampling_params.logprobs == 3 and r["output"][0]["content"][0]["logprobs"] == []
    await api.post("/v1/responses", json={"input": "x", "include": ["message.output_text.logprobs"]})
    assert sent(api).sampling_params.logprobs == 0


@pytest.mark.anyio
async def test_error_mid_stream_ends_with_an_error_event(api) -> None:
    """A request that fails after some output: an error event, then response.failed saying why."""
    task = asyncio.create_task(api.post("/v1/responses", json={"input": "FOREVER", "stream": True}))
    while not any(s.completion_tokens for s in api.state.manager.streams.values()):
        await asyncio.sleep(0.01)
    [stream] = api.state.manager.streams.values()
    stream.push(UserReply(stream.uid, "", True, "error", error="the worker failed"))
    events = events_of((await task).text)
    error, failed = events[-2:]
    assert error["type"] == "error" and error["message"] == "the worker failed"
    assert error["code"] == "server_error"
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "the worker failed"}
    assert "response.output_text.delta" in [e["type"] for e in events]


@pytest.mark.anyio
async def test_disconnect_aborts(api) -> None:
    task = asyncio.create_task(api.post("/v1/responses", json={"input": "FOREVER"}))
    while not api.state.manager.streams:
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for _ in range(100):
        if not api.state.manager.streams:
            break
        await asyncio.sleep(0.01)
    assert not api.state.manager.streams and api.workers.aborted == [sent(api).uid]


def test_builder_without_a_last_chunk_fails_and_keeps_what_it_had() -> None:
    """A stream that ends without a finish reason (aborted): the held-back call is still written,
    the status is failed with an error."""
    builder = ResponseBuilder("smol", {}, ToolOutput("auto", "hermes"))
    kinds = [e["type"] for e in builder.start()]
    kinds += [
        e["type"] for e in builder.feed(Chunk('hi <tool_call>{"name": "f", "arguments": {}}', None, 1, 9))
    ]
    events = builder.complete(response_usage(1, 9, 0))
    kinds += [e["type"] for e in events]
    assert kinds[-1] == "response.failed" and kinds.count("response.output_item.done") == 2
    final = events[-1]["response"]
    assert final["status"] == "failed" and final["error"]["code"] == "server_error"
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["name"] == "f" and final["usage"]["total_tokens"] == 10


REFUSED = [
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [{**WEATHER, "parameters": {"type": "nonsense"}}]}, "tools.0.parameters"),
    ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools.0.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text.format"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER]}, "text.format"),
    ({"text": {"verbosity": "low"}}, "verbosity"),
    ({"top_logprobs": 2, "tools": [WEATHER]}, "top_logprobs"),
    ({"top_logprobs": 99}, "top_logprobs"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
        "input_image",
    ),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input_file"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"input": [{"type": "reasoning", "id": "r", "summary": []}]}, "reasoning"),
    ({"input": [{"role": "critic", "content": "x"}]}, "role"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("extra", "named"), REFUSED)
async def test_refused_fields_are_400_naming_them(api, extra: dict, named: str) -> None:
    r = await api.post("/v1/responses", json={"model": "smol", "input": "hi", **extra})
    err = assert_openai_error(r, 400)
    assert named in err["message"], err
    assert not api.workers.received


@pytest.mark.anyio
async def test_unknown_model_and_overload(api) -> None:
    assert_openai_error(await api.post("/v1/responses", json={"model": "gpt-9", "input": "x"}), 404, "model")
    api.state.status = "stopping"
    assert_openai_error(await api.post("/v1/responses", json={"input": "x"}), 503)


# ---- against the real server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from served("--max-seq-len", "1024", "--served-model-name", "smol")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai_client(server)


def test_real_text_streamed_and_not(client) -> None:
    kw = dict(model="smol", input="What is the capital of France?", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw, instructions="Answer in one short sentence.")
    assert "Paris" in whole.output_text and whole.status in ("completed", "incomplete")
    assert whole.usage.input_tokens > 10 and 0 < whole.usage.output_tokens <= 12
    with client.responses.stream(**kw, instructions="Answer in one short sentence.") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response() if whole.status == "completed" else None
    assert "".join(deltas) == whole.output_text  # greedy: the same text
    if final is not None:
        assert final.output_text == whole.output_text
    short = client.responses.create(model="smol", input="Tell me a long story.", max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 3


def test_real_json_schema(client) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    r = client.responses.create(
        model="smol", input="Describe a person.", max_output_tokens=60, temperature=0, text={"format": fmt}
    )
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)


def test_real_named_tool_choice(client) -> None:
    choice = {"type": "function", "name": "get_weather"}
    r = client.responses.create(
        model="smol",
        input=HISTORY[:1],
        max_output_tokens=60,
        temperature=0,
        tools=[WEATHER],
        tool_choice=choice,
    )
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_real_tool_result_in_the_input_is_rendered(client) -> None:
    r = client.responses.create(
        model="smol", input=HISTORY, max_output_tokens=2, temperature=0, tools=[WEATHER]
    )
    short = client.responses.create(model="smol", input=HISTORY[:1], max_output_tokens=2, temperature=0)
    assert r.usage.input_tokens > short.usage.input_tokens + 20  # the tools, the call and the result


def test_real_stream_disconnect_aborts(server: ServerProcess) -> None:
    body = {"model": "smol", "input": "Tell me a long story.", "max_output_tokens": 400, "stream": True}
    start = len(server.output())
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/responses", json=body) as r:
        for line in r.iter_lines():
            if line == "event: response.output_text.delta":
                break  # leave with the request running: the connection closes here
    server.wait_for_log(re.compile(r"aborted request \d+"), start, timeout=20)


def test_real_logprobs_of_the_output_text(client) -> None:
    r = client.responses.create(
        model="smol",
        input="Name a color.",
        max_output_tokens=5,
        temperature=0,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and "".join(lp.token for lp in lps) == r.output_text
    for lp in lps:  # greedy: each token is the most likely one
        assert len(lp.top_logprobs) == 2 and abs(lp.logprob - lp.top_logprobs[0].logprob) < 1e-4

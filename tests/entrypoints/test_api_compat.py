"""What clients written for OpenAI, vLLM and SGLang expect of the details (issue 25): structured
output through vLLM's and SGLang's fields, stop strings kept in the output, the Responses API's kept
responses, matched_stop, content "" in streamed chat chunks, a forced call cut short, the echo's
logprobs, the model card, and error texts that clients match on. In-process app, fake workers."""

from __future__ import annotations

import asyncio
import json

import pytest
import test_api_app
from llguidance import LLMatcher
from test_api_app import FakeWorkers, anyio_backend, assert_openai_error, chat_body, sse_events  # noqa: F401

from minisgl.core import RequestRejected, SamplingParams, check_request
from minisgl.entrypoints.openai.logprobs_format import CompletionLogprobs
from minisgl.frontend.chunk import Chunk, TokenLogprob
from minisgl.message import TokenizeMsg, UserReply, UserReplyExtra

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]
api = test_api_app.api


def _grammar(api) -> str | None:
    return api.workers.received[-1].sampling_params.grammar


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_choice", ["yes", "no"]),
        ("guided_regex", "[a-z]{3}"),
        ("guided_json", {"type": "object", "properties": {"a": {"type": "integer"}}}),
        ("guided_json", '{"type": "object"}'),
        ("guided_grammar", 'root ::= "a" | "b"'),
        ("guided_grammar", 'start: "a" | "b"'),
        ("structured_outputs", {"choice": ["yes", "no"]}),
        ("structured_outputs", {"regex": "[0-9]+"}),
        ("structured_outputs", {"json": {"type": "array"}}),
        ("structured_outputs", {"grammar": 'root ::= "x"'}),
        ("structured_outputs", {"json_object": True}),
        ("regex", "[a-z]+"),
        ("ebnf", 'root ::= "yes" | "no"'),
        ("json_schema", '{"type": "object"}'),
    ],
)
async def test_structured_output_fields_become_the_grammar(api, field: str, value: object) -> None:
    for path, body in (
        ("/v1/chat/completions", chat_body()),
        ("/v1/completions", {"model": "smol", "prompt": "hi"}),
        ("/generate", {"prompt": "hi", "stream": False}),
    ):
        r = await api.post(path, json={**body, field: value})
        assert r.status_code == 200, r.text
        grammar = _grammar(api)
        assert grammar and LLMatcher.validate_grammar(grammar) == "", grammar  # llguidance takes it


async def test_the_whitespace_of_a_json_constraint(api) -> None:
    schema = {"type": "object"}
    grammars = []
    for extra in (
        {},
        {"guided_whitespace_pattern": "[ ]?"},
        {"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    ):
        body = chat_body(**({"guided_json": schema} if "structured_outputs" not in extra else {}), **extra)
        assert (await api.post("/v1/chat/completions", json=body)).status_code == 200
        grammars.append(_grammar(api))
    assert len(set(grammars)) == 3  # each whitespace setting is its own grammar


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({"guided_choice": ["a"], "guided_regex": "a"}, ("guided_regex", "guided_choice")),
        ({"regex": "a", "response_format": {"type": "json_object"}}, ("response_format", "regex")),
        ({"guided_json": "{not json"}, ("guided_json",)),
        ({"guided_choice": []}, ("guided_choice",)),
        ({"guided_regex": ""}, ("guided_regex",)),
        ({"structured_outputs": {"choise": ["a"]}}, ("choise",)),
        (
            {"structured_outputs": {"json": {}, "disable_additional_properties": True}},
            ("disable_additional_properties",),
        ),
        ({"structured_outputs": {"structural_tag": "{}"}}, ("structural_tag",)),
        ({"guided_whitespace_pattern": " "}, ("guided_whitespace_pattern",)),
        ({"guided_regex": "a", "guided_whitespace_pattern": " "}, ("guided_whitespace_pattern",)),
        ({"guided_json": {"type": "bogus"}}, ("guided_json",)),
        (
            {"guided_choice": ["a"], "tools": [{"type": "function", "function": {"name": "f"}}]},
            ("guided_choice",),
        ),
    ],
)
async def test_bad_structured_output_fields_are_400_naming_them(
    api, extra: dict, names: tuple[str, ...]
) -> None:
    err = assert_openai_error(await api.post("/v1/chat/completions", json=chat_body(**extra)), 400)
    assert all(n in err["message"] for n in names), err
    assert not api.workers.received


async def test_a_stop_string_kept_in_the_output(api) -> None:
    for field in ("include_stop_str_in_output", "no_stop_trim"):
        r = await api.post(
            "/v1/completions", json={"model": "smol", "prompt": "one two three", "stop": ["two"], field: True}
        )
        choice = r.json()["choices"][0]
        assert choice["text"].endswith("two") and choice["matched_stop"] == choice["stop_reason"] == "two"
    r = await api.post("/v1/completions", json={"model": "smol", "prompt": "one two three", "stop": ["two"]})
    assert not r.json()["choices"][0]["text"].endswith("two")


async def test_request_id_names_the_answer(api) -> None:
    r = await api.post("/v1/chat/completions", json=chat_body(request_id="my-1"))
    assert r.json()["id"] == "chatcmpl-my-1"
    r = await api.post("/v1/completions", json={"model": "smol", "prompt": "hi", "rid": "r-2"})
    assert r.json()["id"] == "cmpl-r-2"


async def test_streamed_chat_deltas_always_have_content_text(api) -> None:
    r = await api.post("/v1/chat/completions", json=chat_body(stream=True))
    deltas = [e["choices"][0]["delta"] for e in sse_events(r.text) if e["choices"]]
    assert deltas and all(isinstance(d["content"], str) for d in deltas)
    assert sse_events(r.text)[-1]["choices"][0]["matched_stop"] is None  # ended by EOS


async def test_a_forced_call_cut_short_is_no_call(api) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    choice = {"type": "function", "function": {"name": "f"}}
    r = await api.post("/v1/chat/completions", json=chat_body(tools=tools, tool_choice=choice, max_tokens=2))
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and "tool_calls" not in c["message"], c
    assert c["message"]["content"].startswith("echo: ")  # the two words the fake wrote: no JSON


async def test_the_model_card(api) -> None:
    api.state.root = "/models/smol"
    card = (await api.get("/v1/models/smol")).json()
    assert card["root"] == "/models/smol" and card["max_model_len"] == 2048 and card["parent"] is None


def test_error_texts_clients_match_on() -> None:
    with pytest.raises(
        RequestRejected, match="maximum context length is 64 tokens. However, you requested 74 tokens"
    ):
        check_request([1] * 10, SamplingParams(max_tokens=64), 100, 64)
    with pytest.raises(RequestRejected, match="out of vocabulary"):
        check_request([1, 500], SamplingParams(max_tokens=4), 100, 64)


async def test_a_forced_function_not_in_the_tools(api) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = chat_body(tools=tools, tool_choice={"type": "function", "function": {"name": "g"}})
    err = assert_openai_error(await api.post("/v1/chat/completions", json=body), 400)
    assert "not found in tools list" in err["message"]


def test_logprobs_0_still_shows_the_sampled_token() -> None:
    chunk = Chunk("a", None, 1, 1, logprobs=[TokenLogprob(b"a", -0.5, [])])
    assert CompletionLogprobs().of(chunk)["top_logprobs"] == [{"a": -0.5}]  # type: ignore[index]
    chunk = Chunk("a", None, 1, 1, logprobs=[TokenLogprob(b"a", -0.5, [(b"b", -0.1)])])
    assert CompletionLogprobs().of(chunk)["top_logprobs"] == [{"a": -0.5, "b": -0.1}]  # type: ignore[index]


class EchoWorkers(FakeWorkers):
    """Acknowledges with the prompt's text (echo), then one token with its prompt logprobs."""

    async def run(self, m: TokenizeMsg, uid: int) -> None:
        self.out.put_nowait(
            UserReply(uid, "", False, prompt_tokens=2, extra=UserReplyExtra(prompt_text="Hi you"))
        )
        await asyncio.sleep(0.05)  # the acknowledgement is taken alone first
        extra = UserReplyExtra(
            lp_tokens=[b"!"], lp_values=[-1.0], lp_top_tokens=[[]], lp_top_values=[[]],
            prompt_lp_tokens=[b"Hi", b" you"], prompt_lp_values=[-2.0], prompt_lp_top_tokens=[[]],
            prompt_lp_top_values=[[]],
        )  # fmt: skip
        self.out.put_nowait(UserReply(uid, "!", True, "stop", completion_tokens=1, extra=extra))


async def test_the_echo_comes_with_its_logprobs(api) -> None:
    api.workers.__class__ = EchoWorkers
    body = {"model": "smol", "prompt": "Hi you", "echo": True, "logprobs": 0, "max_tokens": 1, "stream": True}
    r = await api.post("/v1/completions", json=body)
    first = [e for e in sse_events(r.text) if e["choices"]][0]["choices"][0]
    assert first["text"] == "Hi you!"
    assert first["logprobs"]["tokens"] == ["Hi", " you", "!"] and first["logprobs"]["text_offset"] == [
        0,
        2,
        6,
    ]


# ---- the Responses API's kept responses ---------------------------------------------------------


async def test_kept_responses(api) -> None:
    r = await api.post("/v1/responses", json={"model": "smol", "input": "first question"})
    first = r.json()
    assert first["store"] is True
    got = await api.get(f"/v1/responses/{first['id']}")
    assert got.status_code == 200 and got.json() == first
    r = await api.post(
        "/v1/responses",
        json={
            "model": "smol",
            "input": "second question",
            "previous_response_id": first["id"],
            "instructions": "brief",
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["previous_response_id"] == first["id"]
    messages = api.workers.received[-1].text
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]  # type: ignore[index]
    assert messages[2]["content"] == first["output"][0]["content"][0]["text"]  # type: ignore[index]
    deleted = await api.delete(f"/v1/responses/{first['id']}")
    assert deleted.json() == {"id": first["id"], "object": "response", "deleted": True}
    assert_openai_error(await api.get(f"/v1/responses/{first['id']}"), 404, "response_id")
    assert_openai_error(await api.delete(f"/v1/responses/{first['id']}"), 404, "response_id")
    body = {"model": "smol", "input": "x", "previous_response_id": first["id"]}
    err = assert_openai_error(await api.post("/v1/responses", json=body), 400, "previous_response_id")
    assert err["code"] == "previous_response_not_found"  # OpenAI's


async def test_store_false_and_streamed_responses(api) -> None:
    r = await api.post("/v1/responses", json={"model": "smol", "input": "q", "store": False})
    assert r.json()["store"] is False
    assert (await api.get(f"/v1/responses/{r.json()['id']}")).status_code == 404
    r = await api.post("/v1/responses", json={"model": "smol", "input": "q", "stream": True})
    done = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")][-1]
    assert done["type"] == "response.completed"
    kept = await api.get(f"/v1/responses/{done['response']['id']}")
    assert kept.status_code == 200 and kept.json()["output"] == done["response"]["output"]


class CallWorkers(FakeWorkers):
    """Answers every prompt with one call of f, in "required"'s JSON."""

    async def run(self, m: TokenizeMsg, uid: int) -> None:
        self.out.put_nowait(UserReply(uid, "", False, prompt_tokens=2))
        self.out.put_nowait(
            UserReply(uid, '[{"name": "f", "parameters": {}}]', True, "stop", completion_tokens=9)
        )


async def test_a_call_output_answering_a_kept_call(api) -> None:
    api.workers.__class__ = CallWorkers
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    r = await api.post(
        "/v1/responses", json={"model": "smol", "input": "q", "tools": tools, "tool_choice": "required"}
    )
    first = r.json()
    [call] = [i for i in first["output"] if i["type"] == "function_call"]
    answer = [{"type": "function_call_output", "call_id": call["call_id"], "output": "42"}]
    body = {"model": "smol", "previous_response_id": first["id"], "input": answer, "tools": tools}
    r = await api.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    *_, asked, called, answered = api.workers.received[-1].text  # tools in a system prompt first
    assert asked["content"] == "q" and '"name": "f"' in called["content"]  # type: ignore[index]
    assert "<tool_response>\n42" in answered["content"]  # type: ignore[index]
    wrong = {**body, "input": [{**answer[0], "call_id": "nope"}]}
    err = assert_openai_error(await api.post("/v1/responses", json=wrong), 400)
    assert "nope" in err["message"]


def test_the_store_is_bounded() -> None:
    from minisgl.entrypoints.openai.responses.store import ResponseStore

    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(5):
        store.put({"id": f"r{i}", "pad": "x" * 100}, [])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.put({"id": "big", "pad": "x" * 9_900}, [])
    assert store.get("big") is not None and len(store) == 1  # older ones made room
    store.put({"id": "huge", "pad": "x" * 20_000}, [])
    assert store.get("huge") is None and store.get("big") is not None


class PiecemealCallWorkers(FakeWorkers):
    """Answers with two "required" calls, 4 characters per reply."""

    TEXT = '[{"name": "f", "parameters": {"a": "x,}\\"]", "b": [1, {"c": null}]}}, {"name": "g", "parameters": {}}]'

    async def run(self, m: TokenizeMsg, uid: int) -> None:
        self.out.put_nowait(UserReply(uid, "", False, prompt_tokens=2))
        pieces = [self.TEXT[i : i + 4] for i in range(0, len(self.TEXT), 4)]
        for k, piece in enumerate(pieces, 1):
            await asyncio.sleep(0)
            last = k == len(pieces)
            self.out.put_nowait(UserReply(uid, piece, last, "stop" if last else "", completion_tokens=k))


async def test_a_required_call_streams_its_arguments(api) -> None:
    api.workers.__class__ = PiecemealCallWorkers
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in "fg"]
    body = chat_body(tools=tools, tool_choice="required", stream=True)
    events = sse_events((await api.post("/v1/chat/completions", json=body)).text)
    calls = [c for e in events if e["choices"] for c in e["choices"][0]["delta"].get("tool_calls", [])]
    heads = [c for c in calls if "id" in c]
    assert [h["function"]["name"] for h in heads] == ["f", "g"] and [h["index"] for h in heads] == [0, 1]
    args = ["".join(c["function"]["arguments"] for c in calls if c["index"] == i) for i in (0, 1)]
    assert [json.loads(a) for a in args] == [{"a": 'x,}"]', "b": [1, {"c": None}]}, {}]
    assert sum(1 for c in calls if c["index"] == 0 and "id" not in c) > 3  # in pieces, as written
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    r = await api.post("/v1/chat/completions", json={**body, "stream": False})
    whole = r.json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in whole] == [json.loads(a) for a in args]


class TokenWorkers(FakeWorkers):
    """Sends the prompt's ids (1, 2, 3) and each token's id (10, 11, ...) when they are asked for."""

    async def run(self, m: TokenizeMsg, uid: int) -> None:
        asked = m.sampling_params.return_token_ids
        ack = UserReplyExtra(token_ids=[1, 2, 3]) if asked else None
        self.out.put_nowait(UserReply(uid, "", False, prompt_tokens=3, extra=ack))
        for k, word in enumerate(["a", " b", " c"], 1):
            await asyncio.sleep(0)
            extra = UserReplyExtra(token_ids=[9 + k]) if asked else None
            self.out.put_nowait(
                UserReply(uid, word, k == 3, "stop" if k == 3 else "", completion_tokens=k, extra=extra)
            )


async def test_return_token_ids(api) -> None:
    api.workers.__class__ = TokenWorkers
    r = await api.post("/v1/chat/completions", json=chat_body(return_token_ids=True))
    assert r.json()["prompt_token_ids"] == [1, 2, 3] and r.json()["choices"][0]["token_ids"] == [10, 11, 12]
    events = sse_events(
        (await api.post("/v1/chat/completions", json=chat_body(return_token_ids=True, stream=True))).text
    )
    assert events[0]["prompt_token_ids"] == [1, 2, 3]
    assert [t for e in events for t in e["choices"][0].get("token_ids", [])] == [10, 11, 12]
    body = {"model": "smol", "prompt": "x", "return_token_ids": True}
    c = (await api.post("/v1/completions", json=body)).json()["choices"][0]
    assert (c["prompt_token_ids"], c["token_ids"]) == ([1, 2, 3], [10, 11, 12])
    events = sse_events((await api.post("/v1/completions", json={**body, "stream": True})).text)
    assert [e["choices"][0]["prompt_token_ids"] for e in events if "prompt_token_ids" in e["choices"][0]] == [
        [1, 2, 3]
    ]  # once, in the first chunk
    assert "prompt_token_ids" in events[0]["choices"][0]
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == [10, 11, 12]
    r = await api.post("/v1/chat/completions", json=chat_body(return_prompt_token_ids=True))
    assert r.json()["prompt_token_ids"] == [1, 2, 3] and r.json()["choices"][0]["token_ids"] is None
    plain = (await api.post("/v1/chat/completions", json=chat_body())).json()
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None  # vLLM's nulls


async def test_generate_takes_flat_fields(api) -> None:
    body = {"prompt": "hi", "sampling_params": {"max_new_tokens": 3, "regex": "a+"}}
    err = assert_openai_error(await api.post("/generate", json=body), 400)
    assert "sampling_params" in err["message"] and not api.workers.received

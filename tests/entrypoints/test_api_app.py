"""The HTTP API against fake workers (no processes): response shapes, streaming, stop strings,
n > 1, usage, every client error, overload, health and metrics.

The fake tokenizer acknowledges a prompt with its word count, rejects prompts containing "REJECT",
and answers with the words of "echo: <prompt>" one reply per word, each saying that half the prompt's
words (rounded down) came from the prefix cache; "FOREVER" never finishes. An embedding request is
answered with the 4 floats (len(prompt), 1, 0, -1)."""

from __future__ import annotations

import asyncio
import base64
import json
import struct

import httpx
import pytest
from starlette.requests import Request

from minisgl.entrypoints.openai import chat, completions, generate, health
from minisgl.entrypoints.openai.app import create_app
from minisgl.entrypoints.openai.errors import APIError
from minisgl.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from minisgl.entrypoints.openai.state import ServerState
from minisgl.frontend.manager import FrontendManager
from minisgl.message import (
    AbortMsg,
    BaseTokenizerMsg,
    BatchTokenizerMsg,
    TokenizeMsg,
    UserReply,
    UserReplyExtra,
)

pytestmark = [pytest.mark.timeout(30), pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # anyio's pytest plugin runs these async tests on asyncio


class FakeWorkers:
    def __init__(self) -> None:
        self.out: asyncio.Queue = asyncio.Queue()
        self.tasks: dict[int, asyncio.Task] = {}
        self.aborted: list[int] = []
        self.received: list[TokenizeMsg] = []

    async def send(self, msg) -> None:
        msg = BaseTokenizerMsg.from_bytes(msg.to_bytes())  # through the wire format, like a real pipe
        for m in msg.data if isinstance(msg, BatchTokenizerMsg) else [msg]:
            if isinstance(m, TokenizeMsg):
                self.received.append(m)
                for i in range(m.n):  # choice i: uid + i (the real tokenizer also gives it seed + i)
                    self.tasks[m.uid + i] = asyncio.create_task(self.run(m, m.uid + i))
            elif isinstance(m, AbortMsg):
                self.aborted.append(m.uid)
                task = self.tasks.get(m.uid)
                if task is not None:
                    task.cancel()

    async def recv(self):
        return await self.out.get()

    async def run(self, m: TokenizeMsg, uid: int) -> None:
        if isinstance(m.text, str):
            prompt = m.text
        elif m.text and isinstance(m.text[0], dict):
            prompt = " ".join(d["content"] for d in m.text)
        else:
            prompt = " ".join(f"t{t}" for t in m.text)
        if "SILENT" in prompt:
            return  # a tokenizer that never answers
        if "REJECT" in prompt:
            self.out.put_nowait(UserReply(uid, "", True, "error", error="prompt too long for the context"))
            return
        self.out.put_nowait(UserReply(uid, "", False, prompt_tokens=len(prompt.split())))
        if m.sampling_params.embed:  # the pooled state of a model whose hidden size is 4
            vector = struct.pack("<4f", len(prompt), 1.0, 0.0, -1.0)
            self.out.put_nowait(UserReply(uid, "", True, "stop", extra=UserReplyExtra(embedding=vector)))
            return
        words = ("echo: " + prompt).split(" ")
        k = 0
        while True:
            k += 1
            await asyncio.sleep(0.01 if "FOREVER" in prompt else 0)
            piece = words[(k - 1) % len(words)] + " "
            length = m.sampling_params.max_tokens > 0 and k >= m.sampling_params.max_tokens
            done = length or (k >= len(words) and "FOREVER" not in prompt)
            reason = ("length" if length else "stop") if done else ""
            cached = len(prompt.split()) // 2
            self.out.put_nowait(
                UserReply(uid, piece, done, reason, completion_tokens=k, extra=UserReplyExtra(cached))
            )
            if done:
                return


@pytest.fixture
async def api():
    workers = FakeWorkers()
    manager = FrontendManager(workers.send, max_queued_requests=4)
    manager.start(workers.recv)
    state = ServerState(manager, "smol", {"/models/smol"}, max_seq_len=2048, status="serving")
    app = create_app(state)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        client.workers = workers
        client.state = state
        yield client
    await manager.stop()


def chat_body(text: str = "hello there", **kw) -> dict:
    return {"model": "smol", "messages": [{"role": "user", "content": text}], **kw}


def sse_events(text: str) -> list:
    lines = [ln[len("data: ") :] for ln in text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


async def test_chat_completion_shape_and_usage(api) -> None:
    r = await api.post("/v1/chat/completions", json=chat_body("hello there"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "smol"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "echo: hello there "}
    assert choice["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    sent = api.workers.received[-1]
    assert sent.text == [{"role": "user", "content": "hello there"}]
    assert sent.sampling_params.max_tokens == -1  # "fill the context", resolved by the tokenizer


async def test_max_tokens_gives_length(api) -> None:
    r = await api.post("/v1/chat/completions", json=chat_body("a b c d e", max_completion_tokens=2))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "echo: a "


async def test_stop_string_truncates_and_aborts(api) -> None:
    r = await api.post(
        "/v1/completions", json={"model": "smol", "prompt": "one two three four", "stop": ["o th"]}
    )
    choice = r.json()["choices"][0]
    assert choice["text"] == "echo: one tw" and choice["finish_reason"] == "stop"
    assert api.workers.aborted == [api.workers.received[-1].uid]  # the scheduler is told to stop
    assert 3 <= r.json()["usage"]["completion_tokens"] <= 5  # tokens generated, maybe past the stop


async def test_n_choices_and_prompt_lists(api) -> None:
    r = await api.post("/v1/completions", json={"prompt": ["x y", "z"], "n": 2, "seed": 5, "max_tokens": 50})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["echo: x y "] * 2 + ["echo: z "] * 2
    assert body["usage"]["prompt_tokens"] == 3  # each prompt once, not once per choice
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}  # likewise: 2 // 2 + 1 // 2
    assert body["usage"]["completion_tokens"] == 3 + 3 + 2 + 2
    # one message per prompt, tokenized once for both choices; the tokenizer gives choice i seed 5 + i
    assert [(m.n, m.sampling_params.seed) for m in api.workers.received[-2:]] == [(2, 5), (2, 5)]
    r = await api.post("/v1/completions", json={"prompt": [[5, 6], [7]]})
    assert [c["text"] for c in r.json()["choices"]] == ["echo: t5 t6 ", "echo: t7 "]
    r = await api.post("/v1/completions", json={"prompt": [5, 6, 7]})
    assert r.json()["choices"][0]["text"] == "echo: t5 t6 t7 "


async def test_chat_streaming_with_usage(api) -> None:
    body = chat_body("a b", stream=True, n=2, stream_options={"include_usage": True})
    r = await api.post("/v1/chat/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    texts, reasons = ["", ""], [None, None]
    for e in events[:-1]:
        assert e["object"] == "chat.completion.chunk"
        [c] = e["choices"]
        texts[c["index"]] += c["delta"].get("content", "")
        reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
        assert e["usage"] is None
    assert texts == ["echo: a b "] * 2 and reasons == ["stop", "stop"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


async def test_completion_streaming(api) -> None:
    r = await api.post("/v1/completions", json={"prompt": "p q", "stream": True, "stop": "q"})
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events) == "echo: p "
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_generate_native(api) -> None:
    r = await api.post("/generate", json={"prompt": "hi you", "max_tokens": 2})
    events = sse_events(r.text)
    assert "".join(e["text"] for e in events) == "echo: hi " and events[-1]["finish_reason"] == "length"
    r = await api.post("/generate", json={"prompt": "hi", "stream": False})
    assert r.json()["text"] == "echo: hi " and r.json()["prompt_tokens"] == 1


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "smol", "messages": []}, "messages"),
        ({"model": "smol"}, "messages"),
        ({"model": "smol", "messages": "hello"}, "messages"),
        (chat_body(n=0), "n"),
        (chat_body(temperature=-0.5), "temperature"),
        (chat_body(max_tokens="many"), "max_tokens"),
        (chat_body(max_tokens=0), "max_tokens"),
        (chat_body(top_p=0), "top_p"),
        (chat_body(top_k=0), "top_k"),
        (chat_body(stop=[1, 2]), None),
        (chat_body(seed=10**30), "seed"),
        (chat_body(max_tokens=10**30), "max_tokens"),
        (chat_body(top_k=2**40), "top_k"),
        (chat_body(n=1000), "n"),
        (chat_body(presence_penalty=2.5), "presence_penalty"),
        (chat_body(frequency_penalty=-3), "frequency_penalty"),
        (chat_body(repetition_penalty=0), "repetition_penalty"),
        (chat_body(logit_bias={"x": 1}), "logit_bias"),
        (chat_body(logit_bias={"5": 101}), "logit_bias.5"),
        (chat_body(top_logprobs=21, logprobs=True), "top_logprobs"),
        (chat_body(top_logprobs=2), None),
        (chat_body(min_tokens=-1), "min_tokens"),
        (chat_body(stream_options={"include_usage": True}), None),
        (chat_body(add_generation_prompt=True, continue_final_message=True), None),
        (chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]), None),
        ({"model": "smol", "messages": [{"role": "", "content": "x"}]}, "messages.0.role"),
    ],
)
async def test_bad_chat_requests_are_400(api, body: dict, param: str | None) -> None:
    assert_openai_error(await api.post("/v1/chat/completions", json=body), 400, param)
    assert not api.workers.received  # nothing reached the workers


async def test_bad_completion_requests_are_400(api) -> None:
    for body in (
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": 5},
        {"prompt": "x", "echo": "maybe"},
        {"prompt": "x", "logprobs": 21},
        {"prompt": "x", "logprobs": True},
        {"prompt": "x", "best_of": 2},
        {"prompt": "x", "suffix": "y"},
        {"prompt": None},
    ):
        assert_openai_error(await api.post("/v1/completions", json=body), 400)


async def test_malformed_json_is_400(api) -> None:
    r = await api.post(
        "/v1/chat/completions",
        content=b'{"model": "smol", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert "JSON" in assert_openai_error(r, 400)["message"]
    r = await api.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "temperature": Infinity}'):
        r = await api.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_openai_error(r, 400, "temperature")
    r = await api.post("/v1/completions", json={"prompt": [10**30]})
    assert_openai_error(r, 400)


async def test_unencodable_text_is_an_error_not_a_hang(api) -> None:
    """A lone surrogate cannot travel as UTF-8: the request fails at once instead of waiting forever."""
    r = await api.post(
        "/v1/completions",
        content=b'{"prompt": "bad \\ud800 text"}',
        headers={"content-type": "application/json"},
    )
    assert_openai_error(r, 400)
    assert not api.state.manager.streams
    assert (await api.post("/v1/completions", json={"prompt": "fine"})).status_code == 200


async def test_rejected_by_tokenizer_is_400(api) -> None:
    r = await api.post("/v1/chat/completions", json=chat_body("REJECT me"))
    assert "context" in assert_openai_error(r, 400)["message"]
    r = await api.post("/v1/chat/completions", json=chat_body("REJECT me", stream=True))
    assert_openai_error(r, 400)
    r = await api.post("/v1/completions", json={"prompt": ["fine", "REJECT"], "max_tokens": 1})
    assert_openai_error(r, 400)
    await asyncio.sleep(0.05)
    assert not api.state.manager.streams  # the accepted sibling was aborted, nothing leaks


async def test_unknown_model_and_route_are_404(api) -> None:
    err = assert_openai_error(
        await api.post("/v1/chat/completions", json={**chat_body(), "model": "gpt-9"}), 404
    )
    assert err["code"] == "model_not_found"
    assert (
        await api.post("/v1/chat/completions", json={**chat_body(), "model": "/models/smol"})
    ).status_code == 200
    assert_openai_error(await api.get("/v1/nothing"), 404)
    assert_openai_error(await api.get("/v1/chat/completions"), 405)


async def test_overload_is_503_and_disconnect_frees(api) -> None:
    tasks = [asyncio.create_task(api.post("/v1/completions", json={"prompt": "FOREVER"})) for _ in range(4)]
    while len(api.state.manager.streams) < 4:
        await asyncio.sleep(0.01)
    assert_openai_error(await api.post("/v1/completions", json={"prompt": "x"}), 503)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for _ in range(100):
        if not api.state.manager.streams:
            break
        await asyncio.sleep(0.01)
    assert not api.state.manager.streams
    assert sorted(api.workers.aborted) == sorted(m.uid for m in api.workers.received)
    assert (await api.post("/v1/completions", json={"prompt": "x"})).status_code == 200


async def test_health_models_metrics(api) -> None:
    assert (await api.get("/health")).status_code == 200
    models = (await api.get("/v1/models")).json()
    assert models["data"][0]["id"] == "smol" and models["data"][0]["max_model_len"] == 2048
    await api.post("/v1/chat/completions", json=chat_body("m n o"))
    text = (await api.get("/metrics")).text
    for name in (
        "minisgl_num_requests_running",
        "minisgl_num_requests_waiting",
        "minisgl_time_to_first_token_seconds_bucket",
        "minisgl_inter_token_latency_seconds_bucket",
    ):
        assert name in text
    assert "minisgl_prompt_tokens_total 3.0" in text
    assert "minisgl_prompt_tokens_cached_total 1.0" in text  # 3 // 2
    assert "minisgl_prefix_cache_hit_rate 0.333" in text
    assert "minisgl_generation_tokens_total 4.0" in text
    assert 'minisgl_requests_finished_total{finish_reason="stop"} 1.0' in text
    api.state.status = "starting"
    assert (await api.get("/health")).status_code == 503
    assert_openai_error(await api.post("/v1/chat/completions", json=chat_body()), 503)


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    from minisgl.frontend.metrics import ServerMetrics

    m = ServerMetrics()
    m.ttft.observe(0.001)  # on a bound: counted in that bucket (le = less or equal)
    m.ttft.observe(0.003, times=2)
    m.ttft.observe(99.0)
    text = m.render().decode()
    assert 'minisgl_time_to_first_token_seconds_bucket{le="0.001"} 1.0' in text
    assert 'minisgl_time_to_first_token_seconds_bucket{le="0.005"} 3.0' in text
    assert 'minisgl_time_to_first_token_seconds_bucket{le="30.0"} 3.0' in text
    assert 'minisgl_time_to_first_token_seconds_bucket{le="+Inf"} 4.0' in text
    assert "minisgl_time_to_first_token_seconds_count 4.0" in text
    assert abs(m.ttft.sum - 99.007) < 1e-9


# ---- routes called alone (no app, no HTTP): each takes its ServerState as an argument -------------


def bare_request() -> Request:
    """A Starlette request whose client never leaves (for the disconnect polls)."""

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


@pytest.fixture
async def alone():
    workers = FakeWorkers()
    manager = FrontendManager(workers.send)
    manager.start(workers.recv)
    yield ServerState(manager, "smol", max_seq_len=2048, status="serving", created=7), workers
    await manager.stop()


async def test_health_models_and_metrics_routes_alone(alone) -> None:
    state, _ = alone
    assert await health.models(state) == {
        "object": "list",
        "data": [
            {
                "id": "smol",
                "object": "model",
                "created": 7,
                "owned_by": "minisgl",
                "root": "smol",
                "parent": None,
                "max_model_len": 2048,
            }
        ],
    }
    r = await health.health(state)
    assert (r.status_code, json.loads(r.body)) == (200, {"status": "ok"})
    state.status, state.detail = "unhealthy", "rank 1 died"
    r = await health.health(state)
    assert (r.status_code, json.loads(r.body)) == (503, {"status": "unhealthy", "detail": "rank 1 died"})
    r = await health.metrics(state)
    assert r.media_type.startswith("text/plain") and b"minisgl_num_requests_waiting 0.0" in r.body


async def test_generate_and_completions_routes_alone(alone) -> None:
    state, workers = alone
    body = GenerateRequest(prompt="a b c", stream=False, max_tokens=3)
    r = await generate.generate(body, bare_request(), state)
    assert json.loads(r.body) == {
        "text": "echo: a b ",
        "finish_reason": "length",
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "cached_tokens": 1,
    }
    assert workers.received[-1].sampling_params.temperature == 0.0  # /generate's default: greedy
    body = CompletionRequest(prompt="x y", stream=True, stream_options={"include_usage": True})
    r = await completions.completions(body, bare_request(), state)
    events = sse_events(b"".join([chunk async for chunk in r.body_iterator]).decode())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "echo: x y "
    assert events[-1]["usage"]["total_tokens"] == 2 + 3 and not state.manager.streams
    with pytest.raises(APIError) as e:
        await chat.chat(ChatCompletionRequest(**chat_body(model="gpt-9")), bare_request(), state)
    assert (e.value.status, e.value.code) == (404, "model_not_found") and len(workers.received) == 2


async def test_embeddings_shape_usage_and_dimensions(api) -> None:
    from minisgl.models.pooling import PoolingConfig

    api.state.pooling = PoolingConfig("last", 4, (2, 4))
    r = await api.post("/v1/embeddings", json={"model": "smol", "input": ["one two", "three"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "smol"
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    first = [7.0, 1.0, 0.0, -1.0]  # (len("one two"), 1, 0, -1), normalised
    norm = sum(x * x for x in first) ** 0.5
    assert [d["index"] for d in body["data"]] == [0, 1] and {d["object"] for d in body["data"]} == {
        "embedding"
    }
    assert body["data"][0]["embedding"] == pytest.approx([x / norm for x in first], abs=1e-6)
    assert [m.sampling_params.embed for m in api.workers.received] == [True, True]
    r = await api.post(
        "/v1/embeddings", json={"input": "three", "dimensions": 2, "encoding_format": "base64"}
    )
    vector = struct.unpack("<2f", base64.b64decode(r.json()["data"][0]["embedding"]))
    assert vector == pytest.approx([5 / 26**0.5, 1 / 26**0.5], abs=1e-6)
    r = await api.post("/v1/embeddings", json={"input": "three", "dimensions": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions", r.text

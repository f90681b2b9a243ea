"""The HTTP API's limits and its handling of input that cannot travel (issue 9, findings 2, 5, 7),
against the fake workers of test_api_app (through the real wire format, no processes)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from test_api_app import FakeWorkers, assert_openai_error, chat_body

from minisgl.core import SamplingParams
from minisgl.entrypoints.openai.app import create_app
from minisgl.entrypoints.openai.state import ServerState
from minisgl.frontend.errors import RequestError
from minisgl.frontend.manager import FrontendManager

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]

JSON = {"content-type": "application/json"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_client(
    max_queued: int | None = None, **state_kw
) -> tuple[httpx.AsyncClient, FakeWorkers, ServerState]:
    workers = FakeWorkers()
    manager = FrontendManager(workers.send, max_queued_requests=max_queued)
    manager.start(workers.recv)
    state = ServerState(manager, "smol", max_seq_len=2048, status="serving", **state_kw)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t")
    return client, workers, state


@pytest.fixture
async def api():
    client, workers, state = make_client(max_queued=4)
    async with client:
        client.workers, client.state = workers, state
        yield client
    await state.manager.stop()


async def wait_until(cond, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


# ---- finding 2: text that cannot be encoded fails alone ---------------------------------------


async def test_an_unsendable_message_fails_alone_and_no_abort_is_lost() -> None:
    """The API server batches what queued up meanwhile into one send to the tokenizer: one message
    that cannot be encoded must not fail the other 99, nor lose an abort in the same batch."""
    workers = FakeWorkers()
    manager = FrontendManager(workers.send)
    manager.start(workers.recv)
    try:
        params = SamplingParams(max_tokens=2)
        good = [manager.open(f"p{i}", params, [])[0] for i in range(99)]
        [bad] = manager.open("x\ud800", params, [])  # bypasses the HTTP checks
        manager.abort(good[0].uid)  # queued in the same batch
        got = await asyncio.gather(*(s.accepted() for s in [*good[1:], bad]), return_exceptions=True)
        assert got[:-1] == [None] * 98
        assert isinstance(got[-1], RequestError) and "cannot send" in got[-1].message
        assert workers.aborted == [good[0].uid]
    finally:
        await manager.stop()


async def test_lone_surrogate_among_concurrent_requests_is_the_only_400(api) -> None:
    api.state.manager.max_queued_requests = None
    bodies = [json.dumps({"prompt": f"fine {i}", "max_tokens": 2}) for i in range(60)]
    bodies[30] = '{"prompt": "x\\ud800", "max_tokens": 2}'
    rs = await asyncio.gather(*(api.post("/v1/completions", content=b, headers=JSON) for b in bodies))
    assert [r.status_code for r in rs] == [200] * 30 + [400] + [200] * 29
    assert "Unicode" in assert_openai_error(rs[30], 400)["message"]


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}'),
        ("/v1/completions", '{"prompt": "x", "stop": ["a\\udc00"]}'),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}'),
        ("/v1/completions", '{"prompt": "x", "user": "\\ud800"}'),  # an ignored field too
        ("/v1/completions", '{"prompt": "x", "\\ud800": 1}'),  # a key
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}'),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        ),
        ("/v1/chat/completions", '{"model": "\\ud800x", "messages": []}'),
        ("/generate", '{"prompt": "\\ud800"}'),
        ("/generate", '{"prompt": "x", "stop": "\\ud800"}'),
    ],
)
async def test_lone_surrogates_are_400_everywhere_they_enter(api, path: str, raw: str) -> None:
    r = await api.post(path, content=raw.encode(), headers=JSON)
    err = assert_openai_error(r, 400)
    assert "Unicode" in err["message"]
    r.content.decode("utf-8")  # the error itself is valid UTF-8
    assert not api.workers.received


async def test_an_error_that_echoes_a_surrogate_is_still_sent() -> None:
    from minisgl.entrypoints.openai.errors import error_response

    r = error_response(404, "no model '\ud800'", param="\udfff", code="x\ud800")
    body = json.loads(r.body)
    assert body["error"]["message"] == "no model '\\ud800'" and body["error"]["param"] == "\\udfff"


# ---- finding 5: limits ---------------------------------------------------------------------------


async def test_a_body_over_the_cap_is_413_before_it_is_read() -> None:
    client, workers, state = make_client(max_request_bytes=1000)
    async with client:
        big = json.dumps({"prompt": "x" * 2000}).encode()
        err = assert_openai_error(await client.post("/v1/completions", content=big, headers=JSON), 413)
        assert "--max-request-bytes" in err["message"] and "1000" in err["message"]

        async def chunked():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b" " * 300

        r = await client.post("/v1/completions", content=chunked(), headers=JSON)
        assert_openai_error(r, 413)
        ok = json.dumps({"prompt": "x" * 900, "max_tokens": 1}).encode()
        assert (await client.post("/v1/completions", content=ok, headers=JSON)).status_code == 200
        assert len(workers.received) == 1
    await state.manager.stop()


async def test_n_choices_are_one_message_to_the_tokenizer(api) -> None:
    """A prompt with n=64 is sent (and so tokenized) once, not 64 times."""
    api.state.manager.max_queued_requests = None
    text = "word " * 20_000
    r = await api.post("/v1/completions", json={"prompt": text, "n": 64, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 64
    assert [(m.n, len(m.text)) for m in api.workers.received] == [(64, len(text))]
    r = await api.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1})
    assert [c["text"] for c in r.json()["choices"]] == ["echo: "] * 9
    assert [m.n for m in api.workers.received[1:]] == [3, 3, 3]


# ---- finding 7: waits, queue limits, unsupported fields, booleans ----------------------------------


async def test_the_wait_for_the_tokenizer_is_bounded(api) -> None:
    api.state.tokenize_timeout = 0.3
    err = assert_openai_error(await api.post("/v1/completions", json={"prompt": "SILENT"}), 503)
    assert "tokenizer did not answer" in err["message"]
    silent = api.workers.received[-1].uid
    await wait_until(lambda: silent in api.workers.aborted)  # the scheduler is told to forget it
    assert not api.state.manager.streams


async def test_a_client_gone_while_the_tokenizer_is_silent_is_aborted(api) -> None:
    """Calls the app as uvicorn does: the body, then http.disconnect. Nothing cancels the handler; it
    must notice by itself, abort the request and return."""
    app = api._transport.app
    body = json.dumps({"prompt": "SILENT"}).encode()
    sent: list[dict] = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if sent:
            return sent.pop()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("t", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), 10)
    assert api.workers.aborted == [api.workers.received[-1].uid]
    assert not api.state.manager.streams


async def test_more_choices_than_the_queue_holds_is_400_not_503(api) -> None:
    err = assert_openai_error(await api.post("/v1/completions", json={"prompt": "x", "n": 5}), 400)
    assert "--max-queued-requests" in err["message"]
    r = await api.post("/v1/completions", json={"prompt": ["x", "y", "z"], "n": 2})
    assert_openai_error(r, 400)
    assert not api.workers.received
    r = await api.post("/v1/completions", json={"prompt": ["x", "y"], "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
    ],
)
async def test_tool_fields_are_refused_by_name_on_completions(api, field: str, value: object) -> None:
    err = assert_openai_error(
        await api.post("/v1/completions", json={"prompt": "x", field: value}), 400, field
    )
    assert field in err["message"]
    assert not api.workers.received


@pytest.mark.parametrize(
    ("field", "value"),
    [("tool_choice", "auto"), ("tool_choice", "required"), ("function_call", "auto")],
)
async def test_a_tool_choice_without_tools_is_400_naming_it(api, field: str, value: object) -> None:
    err = assert_openai_error(await api.post("/v1/chat/completions", json={**chat_body(), field: value}), 400)
    assert field in err["message"]
    assert not api.workers.received


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", None),
        ("logit_bias", {}),
        ("tools", []),
        ("tool_choice", "none"),
        ("response_format", {"type": "text"}),
    ],
)
async def test_unimplemented_fields_off_are_accepted(api, field: str, value: object) -> None:
    r = await api.post("/v1/chat/completions", json={**chat_body(max_tokens=1), field: value})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [True, False]},
        {"prompt": [[1, True]]},
        {"prompt": [1.0, 2.0]},
        {"prompt": "x", "max_tokens": True},
        {"prompt": "x", "n": "2"},
        {"prompt": "x", "seed": 1.5},
    ],
)
async def test_booleans_strings_and_floats_are_not_integers(api, body: dict) -> None:
    assert_openai_error(await api.post("/v1/completions", json=body), 400)
    if set(body) <= {"prompt", "max_tokens"}:  # the fields /generate has
        assert_openai_error(await api.post("/generate", json=body), 400)
    assert not api.workers.received

"""HTTP fuzzing of the real ASGI app in this process (issue 9's reliability suite): generated bodies
(valid requests with junk fields, arbitrary JSON, NaN, huge numbers, lone surrogates, truncated or
non-UTF-8 bytes) against every endpoint. Every answer is a 2xx or an OpenAI-shaped 4xx, never a
5xx; afterwards no request is left in flight and a normal request is still served.

The workers are test_api_app's fakes behind the real wire format; tests/system/test_fuzz_server.py sends
fewer bodies to a real `minisgl serve --engine dummy`. `make test-slow` runs 25x more."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from test_api_app import FakeWorkers

from fuzzing import check_http_response, http_request
from minisgl.entrypoints.openai.app import create_app
from minisgl.entrypoints.openai.state import ServerState
from minisgl.frontend.manager import FrontendManager

pytestmark = pytest.mark.timeout(900)


class App:
    """The app, its fake workers and a client, on one event loop driven from sync code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        self.workers = FakeWorkers()
        self.manager = FrontendManager(self.workers.send, max_queued_requests=256)
        self.manager.start(self.workers.recv)
        state = ServerState(self.manager, "smol", max_seq_len=2048, status="serving")
        state.tokenize_timeout = 10.0  # a stuck request would show as a 503 (a failure), not a hang
        transport = httpx.ASGITransport(app=create_app(state))
        self.client = httpx.AsyncClient(transport=transport, base_url="http://fuzz", timeout=30)

    def send(self, method: str, path: str, body: bytes) -> httpx.Response:
        headers = {"content-type": "application/json"}
        return self.loop.run_until_complete(self.client.request(method, path, content=body, headers=headers))

    def drained(self) -> bool:
        async def wait() -> bool:
            for _ in range(500):
                if not self.manager.streams:
                    return True
                await asyncio.sleep(0.01)
            return False

        return self.loop.run_until_complete(wait())

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self.manager.stop())
        self.loop.close()


@pytest.fixture
def app() -> Iterator[App]:
    a = App()
    yield a
    a.close()


def fuzz(app: App, examples: int) -> int:
    sent = 0

    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(req=http_request())
    def one(req: tuple[str, str, bytes]) -> None:
        nonlocal sent
        method, path, body = req
        r = app.send(method, path, body)
        sent += 1
        check_http_response(r.status_code, r.headers, r.content)

    one()
    assert app.drained(), f"{len(app.manager.streams)} requests left in flight"
    r = app.send("POST", "/v1/completions", b'{"prompt": "still here", "max_tokens": 3}')
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "echo: still here "
    return sent


def test_fuzz_http_bodies_in_process(app: App, fuzz_report) -> None:
    fuzz_report("HTTP bodies, in-process ASGI app (fake workers)", fuzz(app, 1000))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_http_bodies_in_process_long(app: App, fuzz_report) -> None:
    fuzz_report("HTTP bodies, in-process ASGI app (fake workers), slow run", fuzz(app, 25_000))

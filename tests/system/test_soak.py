"""A bounded soak (issue 9's reliability suite; marked `slow`, run by `make test-slow`): a few
minutes of mixed traffic with aborts against one server (the dummy engine, separate tokenizer and
detokenizer processes), then the server must be healthy, idle, with every KV page free, and no
process may have grown much. Every process's RSS before and after is printed.

MINISGL_SOAK_S sets the duration (default 180 s)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import re
import time

import httpx
import psutil
import pytest
from test_server import ServerProcess
from test_server_lifecycle import wait_no_requests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SOAK_S = float(os.environ.get("MINISGL_SOAK_S", "180"))
WARMUP_S = 15.0
CONCURRENCY = 16
MIB = 1 << 20
# Allowed growth of a process's RSS from after the warm-up to the end (allocator noise included).
GROWTH_LIMIT = 64 * MIB


def rss_by_process(srv: ServerProcess) -> dict[str, int]:
    names = {int(pid): name for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", srv.output())}
    out = {"launcher": psutil.Process(srv.proc.pid).memory_info().rss}
    for p in srv.children:
        out[names.get(p.pid, "resource tracker")] = p.memory_info().rss
    return out


class Traffic:
    """Requests of every kind, each checked; counts what happened."""

    def __init__(self, url: str, seed: int) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.counts: collections.Counter[str] = collections.Counter()

    async def one(self, c: httpx.AsyncClient) -> None:
        kind = self.rng.choice(
            [
                "stream",
                "stream",
                "drop",
                "drop",
                "blocking",
                "timeout",
                "n3",
                "generate",
                "stop",
                "bad",
                "probe",
            ]
        )
        await getattr(self, f"_{kind}")(c)
        self.counts[kind] += 1

    def _body(self, **kw: object) -> dict:
        return {
            "prompt": "Once upon a time",
            "max_tokens": self.rng.randint(1, 200),
            "ignore_eos": True,
            **kw,
        }

    async def _stream(self, c: httpx.AsyncClient) -> None:
        body = self._body(stream=True, stream_options={"include_usage": True})
        lines = []
        async with c.stream("POST", self.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        usage = json.loads(lines[-2][len("data: ") :])["usage"]
        assert usage["completion_tokens"] == body["max_tokens"], usage

    async def _drop(self, c: httpx.AsyncClient) -> None:
        """A chat stream the client leaves after a few events: the server aborts it."""
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000, "stream": True}
        async with c.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            async for _ in r.aiter_lines():
                n += 1
                if n >= self.rng.randint(1, 6):
                    break

    async def _blocking(self, c: httpx.AsyncClient) -> None:
        r = await c.post(self.url + "/v1/completions", json=self._body())
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text

    async def _timeout(self, c: httpx.AsyncClient) -> None:
        """A non-streaming client that gives up: the server notices and aborts."""
        try:
            await c.post(self.url + "/v1/completions", json=self._body(max_tokens=90_000), timeout=0.2)
        except httpx.TimeoutException:
            return

    async def _n3(self, c: httpx.AsyncClient) -> None:
        r = await c.post(self.url + "/v1/completions", json=self._body(n=3, max_tokens=16))
        assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text

    async def _generate(self, c: httpx.AsyncClient) -> None:
        body = {"prompt": "Hello", "max_tokens": 32, "ignore_eos": True}
        async with c.stream("POST", self.url + "/generate", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]"

    async def _stop(self, c: httpx.AsyncClient) -> None:
        r = await c.post(self.url + "/v1/completions", json=self._body(stop=["e", " a"], max_tokens=64))
        assert r.status_code == 200, r.text

    async def _bad(self, c: httpx.AsyncClient) -> None:
        r = await c.post(self.url + "/v1/completions", json={"prompt": "x", "temperature": -1})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text

    async def _probe(self, c: httpx.AsyncClient) -> None:
        assert (await c.get(self.url + "/health")).status_code == 200
        assert (await c.get(self.url + "/metrics")).status_code == 200

    async def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds

        async def worker() -> None:
            async with httpx.AsyncClient(timeout=60) as c:
                while time.monotonic() < deadline:
                    await self.one(c)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


def test_soak_mixed_traffic_with_aborts() -> None:
    srv = ServerProcess("--engine", "dummy", "--num-tokenizer", "1", "--max-seq-len", "100000")
    try:
        traffic = Traffic(srv.url, seed=9)
        asyncio.run(traffic.run(WARMUP_S))
        wait_no_requests(srv.url)
        before = rss_by_process(srv)
        traffic.counts.clear()
        start = time.monotonic()
        asyncio.run(traffic.run(SOAK_S))
        took = time.monotonic() - start
        wait_no_requests(srv.url)
        after = rss_by_process(srv)

        total = sum(traffic.counts.values())
        print(
            f"\nsoak: {total} requests in {took:.0f} s after a {WARMUP_S:g} s warm-up; by kind: {dict(traffic.counts)}"
        )
        print(f"{'process':<20}{'RSS before':>14}{'RSS after':>14}{'change':>12}")
        for name in before:
            b, a = before[name], after[name]
            print(f"{name:<20}{b / MIB:>11.1f} MiB{a / MIB:>11.1f} MiB{(a - b) / MIB:>+9.1f} MiB")

        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        mark = len(srv.output())
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
        m = srv.wait_for_log(
            re.compile(r"scheduler idle: 0 running, 0 waiting, pages free (\d+)/(\d+), cached (\d+)"), mark
        )
        free, total, cached = map(int, m.groups())
        assert free + cached == total  # every KV page came back (free, or in the prefix cache)
        grown = {n: (after[n] - before[n]) / MIB for n in before if after[n] - before[n] > GROWTH_LIMIT}
        assert not grown, f"RSS grew more than {GROWTH_LIMIT / MIB:.0f} MiB: {grown}"
        assert srv.stop() == 0 and srv.leftovers() == []
        assert "did not stop" not in srv.output()
    finally:
        srv.stop()

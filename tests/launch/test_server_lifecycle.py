"""The server's life with the dummy engine (no model: fast): --num-tokenizer N>0, overload 503,
SIGTERM leaving no process and no socket file, a killed worker making /health 503 and the server
exit, and the serving benchmark client producing sane figures."""

from __future__ import annotations

import asyncio
import json
import math
import os
import pstats
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from test_server import ServerProcess

pytestmark = pytest.mark.timeout(180)


def wait_no_requests(url: str, timeout: float = 20.0) -> None:
    """Until the API server has no request in flight (closed connections are noticed asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = httpx.get(url + "/metrics", timeout=5).text
        if re.search(r"^minisgl_num_requests_running 0\.0$", m, re.M) and re.search(
            r"^minisgl_num_requests_waiting 0\.0$", m, re.M
        ):
            return
        time.sleep(0.1)
    raise AssertionError("requests still in flight")


async def burst(url: str, n: int, max_tokens: int) -> list[httpx.Response]:
    """n concurrent non-streaming completions."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True}
        return await asyncio.gather(*(c.post(url + "/v1/completions", json=body) for _ in range(n)))


def chat(url: str, **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


@pytest.fixture(scope="module")
def pool_server():
    """A dummy-engine server with two tokenizer processes and room for 4 requests in flight.
    The last test of this module stops it with SIGTERM."""
    srv = ServerProcess(
        "--engine", "dummy", "--num-tokenizer", "2", "--max-queued-requests", "4", "--max-seq-len", "100000",
        "--dummy-step-ms", "0.2",  # a 90,000-token request takes >= 18 s on any host
    )  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


def test_tokenizer_pool(pool_server) -> None:
    srv = pool_server
    assert len(srv.children) >= 4  # scheduler, 2 tokenizers, detokenizer
    for _ in range(4):  # dealt round robin over both tokenizers
        r = chat(srv.url, n=2)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
        assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] == 16


def test_overload_is_503(pool_server) -> None:
    """Four endless streams fill --max-queued-requests 4: one more request gets 503."""
    srv = pool_server
    long = {"prompt": "x", "max_tokens": 90_000, "ignore_eos": True, "stream": True}
    started = threading.Barrier(5)
    stop = threading.Event()

    def stream() -> None:
        with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + "/v1/completions", json=long) as r:
            lines = r.iter_lines()
            next(lines)
            started.wait()
            stop.wait(30)

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait(30)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    stop.set()
    for t in threads:
        t.join(30)
    assert r.status_code == 503 and r.json()["error"]["message"].startswith("the server is busy")
    wait_no_requests(srv.url)  # the closed streams were aborted and forgotten


def test_overload_burst_is_503_or_served(pool_server) -> None:
    """100 requests at once against --max-queued-requests 4: each is served or refused with a 503 in
    OpenAI's shape, and the server serves again afterwards."""
    srv = pool_server
    responses = asyncio.run(burst(srv.url, 100, 500))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and codes.count(503) > 0 and codes.count(200) >= 4, sorted(codes)
    for r in responses:
        if r.status_code == 503:
            err = r.json()["error"]
            assert err["type"] == "service_unavailable_error", err
            assert err["message"].startswith("the server is busy"), err
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
    wait_no_requests(srv.url)
    assert chat(srv.url).status_code == 200


def test_non_streaming_disconnect_aborts(pool_server) -> None:
    srv = pool_server
    start = len(srv.output())
    body = {"prompt": "x", "max_tokens": 90_000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)
    line = srv.wait_for_log(re.compile(r"scheduler: aborted request \d+ \((\d+) tokens generated\)"), start)
    assert int(line.group(1)) < 90_000
    wait_no_requests(srv.url)


def test_bench_client_against_dummy_server(pool_server, tmp_path) -> None:
    from minisgl.cli.main import main

    srv = pool_server
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(
        "bench serve --base-url".split()
        + [srv.url]
        + "--num-prompts 12 --concurrency 4 --output-len 16 --input-len 8 --output-json".split()
        + [str(out)]
        + "--plot".split()
        + [str(png)]
    )
    assert code == 0
    s = json.loads(out.read_text())
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["output_tokens"] == 12 * 16  # ignore_eos: every request has exactly --output-len tokens
    assert s["input_tokens"] >= 12 * 8
    assert s["output_throughput"] > 0 and s["request_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        d = s[key]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
    # ITL needs two chunks in one stream; the fast dummy engine may deliver a whole 16-token answer
    # in one SSE chunk (the server merges what queued up), and then there is no gap to measure.
    itl = s["itl_ms"]
    assert all(math.isnan(v) for v in itl.values()) or 0 <= itl["p50"] <= itl["p90"] <= itl["p99"], itl
    assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    # The same requests at a fixed rate.
    code = main(
        "bench serve --base-url".split()
        + [srv.url]
        + "--num-prompts 6 --request-rate 20 --output-len 4 --warmup 0 --endpoint chat --output-json".split()
        + [str(out)]
    )
    assert code == 0 and json.loads(out.read_text())["completed"] == 6


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU sets")
def test_every_thread_has_every_cpu_once_serving(pool_server) -> None:
    """While the children start, the launcher and the tokenizer workers keep to one CPU (the others
    are the schedulers'); once /health says 200 every thread of the server may run anywhere again."""
    want = os.sched_getaffinity(0)
    for proc in [psutil.Process(pool_server.proc.pid), *pool_server.children]:
        for t in proc.threads():
            assert os.sched_getaffinity(t.id) == want, (proc.cmdline()[-2:], t.id)


def test_sigterm_leaves_no_process_and_no_socket(pool_server) -> None:
    srv = pool_server
    assert srv.stop(signal.SIGTERM) == 0
    assert srv.leftovers() == []
    assert "did not stop" not in srv.output(), srv.output()  # every child left on its own, none killed
    assert "scheduler rank 0: stopping" in srv.output()
    assert not srv.ipc_root.exists() or not any(srv.ipc_root.iterdir())


def test_killed_worker_makes_health_503_and_server_exit() -> None:
    srv = ServerProcess("--engine", "dummy")
    try:
        m = re.search(r"started tokenizer\+detokenizer \(pid (\d+)\)", srv.output())
        assert m, srv.output()
        psutil.Process(int(m.group(1))).kill()
        saw_503 = False
        deadline = time.monotonic() + 30
        while srv.proc.poll() is None and time.monotonic() < deadline:
            try:
                r = httpx.get(srv.url + "/health", timeout=1)
                if r.status_code == 503:
                    saw_503 = True
                    assert "tokenizer+detokenizer was killed by signal 9" in r.json()["detail"]
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert saw_503
        srv.proc.wait(30)
        assert srv.stop() == 1
        assert "tokenizer+detokenizer was killed by signal 9; shutting the server down" in srv.output()
        assert srv.leftovers() == []
    finally:
        srv.stop()


def test_two_tensor_parallel_ranks_serve_and_stop_cleanly(tmp_path: Path) -> None:
    """--tp 2 (gloo on the CPU, dummy engine): both scheduler ranks start, rank 0 forwards every
    request to rank 1, replies come back, both ranks end up with the same KV pool and prefix cache
    (their idle lines agree), and SIGTERM stops both ranks without a kill. With MINISGL_CPROFILE each
    process leaves its cProfile dump when it stops."""
    profiles = tmp_path / "prof"
    srv = ServerProcess("--engine", "dummy", "--tp", "2", env={"MINISGL_CPROFILE": str(profiles)})
    try:
        for rank in (0, 1):
            assert f"scheduler rank {rank} ready" in srv.output(), srv.output()
        m = re.search(r"started scheduler rank 1 \(pid (\d+)\)", srv.output())
        assert m, srv.output()
        rank1_idle = rf"\[{m.group(1)} minisgl\.scheduler\.scheduler\] scheduler idle"
        idle_before = len(re.findall(rank1_idle, srv.output()))
        for n in (1, 2):
            r = chat(srv.url, n=n)
            assert r.status_code == 200, r.text
            body = r.json()
            assert len(body["choices"]) == n and body["usage"]["completion_tokens"] == 8 * n
        long = {"prompt": "word " * 300, "max_tokens": 4}
        usage = [httpx.post(srv.url + "/v1/completions", json=long, timeout=60).json()["usage"] for _ in "ab"]
        assert usage[1]["prompt_tokens_details"]["cached_tokens"] >= usage[1]["prompt_tokens"] - 16
        wait_no_requests(srv.url)
        pids = [
            re.search(rf"started scheduler rank {r} \(pid (\d+)\)", srv.output()).group(1) for r in (0, 1)
        ]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # each rank logs its state when it goes idle
            lines = [
                re.findall(rf"\[{pid} minisgl\.scheduler\.scheduler\] (scheduler idle: .*)", srv.output())
                for pid in pids
            ]
            if all(lines) and lines[0][-1] == lines[1][-1] and "from the cache 0/" not in lines[0][-1]:
                break
            time.sleep(0.2)
        assert lines[0][-1] == lines[1][-1] and "from the cache 0/" not in lines[0][-1], lines
        assert srv.stop(signal.SIGTERM) == 0
        # rank 1 logs going idle again after work: it ran the forwarded requests too
        assert len(re.findall(rank1_idle, srv.output())) > idle_before, srv.output()
        assert srv.leftovers() == []
        assert "did not stop" not in srv.output(), srv.output()
        for rank in (0, 1):
            assert f"scheduler rank {rank}: stopping" in srv.output(), srv.output()
        dumps = {p.name.rsplit("-", 1)[0]: p for p in profiles.glob("*.prof")}
        assert len(list(profiles.glob("run_scheduler-*.prof"))) == 2, sorted(profiles.iterdir())
        assert {"launcher", "run_scheduler", "run_tokenizer_worker"} <= set(dumps), sorted(dumps)
        functions = {fn for _, _, fn in pstats.Stats(str(dumps["run_scheduler"])).stats}  # type: ignore[attr-defined]
        assert "run_forever" in functions
    finally:
        srv.stop()


def test_log_level_warning_quiets_uvicorn_too() -> None:
    """--log-level governs uvicorn's loggers as well as minisgl's: no INFO line from either."""
    srv = ServerProcess("--engine", "dummy", "--log-level", "warning")
    try:
        assert chat(srv.url).status_code == 200
        assert httpx.get(srv.url + "/nope", timeout=10).status_code == 404
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    out = srv.output()
    assert "minisgl: serving" in out, out  # printed, not logged
    info = [line for line in out.splitlines() if line.startswith("INFO:") or re.match(r"^[\d:]+ I \[", line)]
    assert info == [], out

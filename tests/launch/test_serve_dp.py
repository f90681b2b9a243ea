"""--dp: replicas behind one API server (the dummy engine): requests are spread over every replica,
aborts reach the replica that holds the request, /metrics has per-replica families, and a replica
that dies takes the server to 503 and down (as a dead scheduler does)."""

from __future__ import annotations

import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from test_reliability_procs import pid_of
from test_server import ServerProcess

pytestmark = pytest.mark.timeout(180)


def _metric(text: str, name: str, replica: int) -> float:
    m = re.search(rf'^{name}{{replica="{replica}"}} (\S+)$', text, re.M)
    assert m, f"no {name} for replica {replica} in:\n{text}"
    return float(m.group(1))


def _complete(url: str, max_tokens: int = 8) -> dict:
    body = {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def dp_server():
    server = ServerProcess("--engine", "dummy", "--dp", "2", "--dummy-step-ms", "20", startup_timeout=120)
    yield server  # the last test kills a replica, which ends the server with code 1
    server.stop()
    assert server.orphans == []


def _served_by(url: str, n: int) -> list[str]:
    """Open `n` long streams at once, each until its first token, then close them all: the scheduler
    that held each logs its abort. Returns the first data line of each (the requests ran)."""
    body = {"prompt": "hello", "max_tokens": 5000, "ignore_eos": True, "stream": True}
    all_started = threading.Barrier(n + 1)

    def one(_: int) -> str:
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            first = next(line for line in r.iter_lines() if line)
            all_started.wait(60)  # every stream runs before any is closed
            return first

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        all_started.wait(60)
        return [f.result() for f in futures]


_ABORTED = re.compile(r"\[(\d+) minisgl\.scheduler\.scheduler\] scheduler: aborted request (\d+)")


def test_dp_spreads_requests_over_both_replicas(dp_server: ServerProcess) -> None:
    """Counted by the replica that served each request (its scheduler's log of the request's
    abort), not by the router's own count of where it sent them."""
    pids = {pid_of(dp_server, f"scheduler replica {r}"): r for r in (0, 1)}
    start = len(dp_server.output())
    firsts = _served_by(dp_server.url, 16)
    assert all(line.startswith("data: {") for line in firsts), firsts
    deadline = time.monotonic() + 30
    while len(found := _ABORTED.findall(dp_server.output(), start)) < 16 and time.monotonic() < deadline:
        time.sleep(0.1)
    served = {int(uid): pids[int(pid)] for pid, uid in found}
    assert len(found) == len(served) == 16, found  # each request held by exactly one replica
    per_replica = [list(served.values()).count(r) for r in (0, 1)]
    print(f"\n16 requests: served by replica 0 / 1: {per_replica}")
    assert min(per_replica) >= 4, per_replica  # least-loaded routing keeps them close to even
    with ThreadPoolExecutor(8) as pool:  # and requests that run to the end are answered in full
        outs = list(pool.map(lambda _: _complete(dp_server.url), range(8)))
    assert all(o["choices"][0]["finish_reason"] == "length" for o in outs)
    assert all(o["usage"]["completion_tokens"] == 8 for o in outs)
    for name in ("minisgl_replica_requests_running", "minisgl_replica_requests_waiting"):
        assert _wait_metric(dp_server.url, name, lambda v: v == [0, 0]) == [0, 0]  # reported back to idle


def test_dp_reports_load_and_aborts_reach_the_replica(dp_server: ServerProcess) -> None:
    """Two long streams land on different replicas (least loaded), both report running 1; closing the
    streams aborts them on their replicas, which report 0 again."""
    clients = [httpx.Client(timeout=60) for _ in range(2)]
    body = {"prompt": "x", "max_tokens": 5000, "ignore_eos": True, "stream": True}
    streams = [c.stream("POST", dp_server.url + "/v1/completions", json=body) for c in clients]
    try:
        lines = [s.__enter__().iter_lines() for s in streams]  # kept: a dropped one closes its stream
        for it in lines:
            next(it)  # the first event: the request runs
        running = _wait_metric(dp_server.url, "minisgl_replica_requests_running", lambda v: v == [1, 1])
        assert running == [1, 1]
    finally:
        for s in streams:
            s.__exit__(None, None, None)
        for c in clients:
            c.close()
    assert _wait_metric(dp_server.url, "minisgl_replica_requests_running", lambda v: v == [0, 0]) == [0, 0]


def _wait_metric(url: str, name: str, ok, timeout: float = 20.0) -> list[float]:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        values = [_metric(text, name, r) for r in (0, 1)]
        if ok(values) or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def test_a_dead_replica_takes_the_server_down(dp_server: ServerProcess) -> None:
    """Last in this module: it ends the shared server."""
    psutil.Process(pid_of(dp_server, "scheduler replica 1")).send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 20
    statuses = []
    while time.monotonic() < deadline and dp_server.proc.poll() is None:
        try:
            statuses.append(httpx.get(dp_server.url + "/health", timeout=2).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    assert dp_server.proc.wait(30) == 1
    assert 503 in statuses, statuses
    assert "scheduler replica 1 was killed by signal 9; shutting the server down" in dp_server.output()

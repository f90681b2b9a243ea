"""Connection limits and the request deadline (issue 22, findings 6 and 7), against a real server
(the dummy engine) with small limits: clients that trickle their headers or body are closed after
--read-timeout (idle keep-alive connections keep uvicorn's 5 s), a connection past --max-connections
gets 503 in OpenAI's shape (but /health still answers), running out of descriptors is logged once
per interval instead of once per accept attempt (167,834 tracebacks in 20 s before), and a request
past --request-timeout ends with finish_reason "abort", dropped by the scheduler."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import re
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from test_reliability_procs import Stream
from test_server import ServerProcess

from minisgl.entrypoints.openai.connections import EveryInterval, log_accept_errors

pytestmark = pytest.mark.timeout(180)

READ_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 16  # more than the slow-client test opens
REQUEST_TIMEOUT_S = 3.0
OPEN_FILES = 256  # the server's descriptor limit, so that a test can exhaust it


def test_every_interval_logs_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    report = EveryInterval(interval_s=10.0)
    with caplog.at_level(logging.INFO, logger="minisgl.server"):
        for t in range(26):
            report.event("accept failed", now=1000.0 + t)
    assert [r.getMessage() for r in caplog.records] == [
        "accept failed (once since the last report)",
        "accept failed (10 times since the last report)",
        "accept failed (10 times since the last report)",
    ]
    assert report.total == 26 and report.count == 5


def test_accept_errors_are_rate_limited_and_other_errors_pass(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    try:
        log_accept_errors(loop)
        with caplog.at_level(logging.INFO):
            for _ in range(2048):  # what one turn of asyncio's accept loop reports
                loop.call_exception_handler(
                    {
                        "message": "socket.accept() out of system resource",
                        "exception": OSError(errno.EMFILE, "Too many open files"),
                    }
                )
            loop.call_exception_handler({"message": "something else", "exception": ValueError("x")})
    finally:
        loop.close()
    messages = [(r.name, r.getMessage()) for r in caplog.records]
    assert messages[0][0] == "minisgl.server" and "Too many open files" in messages[0][1], messages
    assert messages[1][0] == "asyncio" and "something else" in messages[1][1], messages
    assert len(messages) == 2, messages


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(
        "--engine", "dummy", "--dummy-step-ms", "1", "--max-seq-len", "100000",
        "--read-timeout", str(READ_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
        "--request-timeout", str(REQUEST_TIMEOUT_S),
        open_files=OPEN_FILES,
    )  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


def _connect(srv: ServerProcess, first: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    if first:
        s.sendall(first)
    s.setblocking(False)
    return s


def _is_closed(s: socket.socket) -> bool:
    """Whether the server closed `s` (what it sent meanwhile is read and dropped)."""
    try:
        while True:
            if s.recv(65536) == b"":
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def _request(path: str, body: bytes = b"", method: str = "POST", length: int | None = None) -> bytes:
    """A request's bytes; `length` larger than the body's makes a request whose body is unfinished."""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body


def _response(s: socket.socket, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """Read one response with a Content-Length from `s`."""
    s.setblocking(True)
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        body += s.recv(65536)
    s.setblocking(False)
    return int(lines[0].split()[1]), headers, body


def _healthy(srv: ServerProcess) -> bool:
    return httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_slow_clients_are_closed_after_the_read_timeout(server) -> None:
    """Silent connections, connections that trickle their headers, and ones that trickle a body one
    byte at a time all end after --read-timeout; an idle keep-alive connection outlives that (its
    limit is uvicorn's), and the server answers others throughout."""
    start = len(server.output())
    silent = [_connect(server) for _ in range(3)]
    headers = [_connect(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(3)]
    body = [_connect(server, _request("/v1/completions", b"{", length=90)) for _ in range(3)]
    idle = _connect(server, _request("/health", method="GET"))
    assert _response(idle)[0] == 200
    t0 = time.monotonic()
    slow = {"silent": silent, "headers": headers, "body": body}
    closed_after: dict[str, list[float]] = {k: [] for k in slow}
    open_ = {(k, i) for k, socks in slow.items() for i in range(len(socks))}
    idle_open_at = None
    while (open_ or idle_open_at is None) and time.monotonic() - t0 < 20:
        for k, i in sorted(open_):
            s = slow[k][i]
            if _is_closed(s):
                closed_after[k].append(time.monotonic() - t0)
                open_.discard((k, i))
            elif k != "silent":
                try:
                    s.send(b"a")  # one more byte, never a complete request
                except OSError:
                    pass
        if time.monotonic() - t0 > READ_TIMEOUT_S + 0.5 and idle_open_at is None:
            idle_open_at = time.monotonic() - t0 if not _is_closed(idle) else -1.0
        assert _healthy(server)
        time.sleep(0.2)
    assert not open_, f"still open after 20 s: {sorted(open_)}"
    flat = [t for ts in closed_after.values() for t in ts]
    print(
        f"\nslow connections closed {min(flat):.2f}-{max(flat):.2f} s after they started sending "
        f"(--read-timeout {READ_TIMEOUT_S:g}): "
        + ", ".join(f"{k} {max(v):.2f} s" for k, v in closed_after.items())
    )
    assert idle_open_at is not None and idle_open_at > READ_TIMEOUT_S, idle_open_at  # keep-alive kept
    for s in [*silent, *headers, *body, idle]:
        s.close()
    out = server.output()[start:]
    assert "within --read-timeout" in out and "Traceback" not in out, out


def test_a_connection_past_max_connections_gets_503(server) -> None:
    held = [_connect(server, _request("/health", method="GET")) for _ in range(MAX_CONNECTIONS)]
    try:
        for s in held:  # each answered, then idle (keep-alive): they all count
            assert _response(s)[0] == 200
        extra = _connect(server, _request("/v1/completions", b'{"prompt": "x", "max_tokens": 2}'))
        status, headers, body = _response(extra)
        assert status == 503 and headers["connection"] == "close", (status, headers)
        err = json.loads(body)["error"]
        assert err["type"] == "service_unavailable_error" and "--max-connections" in err["message"], err
        deadline = time.monotonic() + 10
        while not _is_closed(extra) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _is_closed(extra)
        probe = _connect(server, _request("/health", method="GET"))  # over the cap too
        assert _response(probe)[0] == 200
        probe.close()
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the server notices the closed ones
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        if r.status_code == 200:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def test_running_out_of_descriptors_is_logged_once_per_interval(server) -> None:
    """More connections than the server has descriptors: accepting fails, which is said in one line
    (not a traceback per attempt), and once the connections are gone the server serves again."""
    start = len(server.output())
    socks = [_connect(server) for _ in range(OPEN_FILES + 50)]
    time.sleep(2.0)
    for s in socks:
        s.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not _healthy(server):
        time.sleep(0.2)
    assert _healthy(server)
    out = server.output()[start:]
    lines = re.findall(r"cannot accept HTTP connections: Too many open files.*", out)
    print(f"\n{len(socks)} connections against {OPEN_FILES} descriptors: {len(out)} bytes logged: {lines}")
    assert len(lines) == 1, out[-3000:]
    assert "out of system resource" not in out and "Traceback" not in out, out[-3000:]


def test_a_request_past_request_timeout_ends_with_abort(server) -> None:
    start = len(server.output())
    t0 = time.monotonic()
    body = {"prompt": "x", "max_tokens": 99_000, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "abort" and out["choices"][0]["text"], out["choices"]
    assert 0 < out["usage"]["completion_tokens"] < 99_000
    streamed = Stream(server.url, 99_000).start()
    streamed.wait_ended(REQUEST_TIMEOUT_S + 30)
    assert streamed.finish_reason() == "abort", streamed.lines[-2:]
    print(f"\na request past --request-timeout {REQUEST_TIMEOUT_S:g}: answered after {took:.2f} s")
    deadline = time.monotonic() + 10  # the scheduler's line for the second abort may come a moment later
    while len(re.findall(r"scheduler: aborted request \d+", server.output()[start:])) < 2:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    log = server.output()[start:]
    assert len(re.findall(r"request \d+ aborted: it ran past --request-timeout", log)) == 2, log
    assert len(re.findall(r"scheduler: aborted request \d+", log)) == 2, log  # dropped there too
    short = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30)
    assert short.json()["choices"][0]["finish_reason"] == "length"

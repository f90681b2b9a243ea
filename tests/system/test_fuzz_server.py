"""Fuzzing a real `minisgl serve --engine dummy` (issue 9's reliability suite): generated HTTP bodies
over TCP, and generated frames on the two sockets a server binds for its workers to connect to —
the scheduler's backend input and the API server's reply input. Each receiver logs and drops what it
cannot decode, and ignores what it decodes but cannot use; afterwards every process is still up and
a normal request is served. (The tokenizer's and detokenizer's inputs are fuzzed in
tests/system/test_fuzz_workers.py: their sockets connect, so a test must bind them.)"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import httpx
import psutil
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_server import ServerProcess

from fuzzing import OUTSIDE_API_UIDS, byte_mutants, check_http_response, frame, http_request
from minisgl.message import BaseBackendMsg, BatchBackendMsg, ExitMsg, MessageDecodeError

pytestmark = pytest.mark.timeout(600)

_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(
        "--engine", "dummy", "--max-seq-len", "256", "--max-queued-requests", "256", "--log-level", "info"
    )
    try:
        yield srv
    finally:
        srv.stop()


def assert_serving(srv: ServerProcess) -> None:
    """Every process is up and a normal request is answered."""
    assert srv.proc.poll() is None, srv.output()[-3000:]
    for child in srv.children:
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE, child
    body = {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    assert httpx.get(srv.url + "/health").status_code == 200


def fuzz_http(srv: ServerProcess, examples: int) -> int:
    sent = 0
    with httpx.Client(base_url=srv.url, timeout=60) as client:

        @settings(max_examples=examples, **_SETTINGS)
        @given(req=http_request())
        def one(req: tuple[str, str, bytes]) -> None:
            nonlocal sent
            method, path, body = req
            r = client.request(method, path, content=body, headers={"content-type": "application/json"})
            sent += 1
            check_http_response(r.status_code, r.headers, r.content)

        one()
    assert_serving(srv)
    return sent


def _commands_the_server(raw: bytes) -> bool:
    """Frames that are valid commands, not fuzz: an ExitMsg (the scheduler's legitimate stop
    command; its socket sits in a private 0700 directory), and requests or aborts for uids the API
    server hands out (an abort for a uid not yet seen is kept, rightly, for the request to come)."""
    try:
        msg = BaseBackendMsg.from_bytes(raw)
    except MessageDecodeError:
        return False
    stack = [msg]
    while stack:
        m = stack.pop()
        if isinstance(m, ExitMsg) or getattr(m, "uid", 2**40) < 2**40:
            return True
        if isinstance(m, BatchBackendMsg):
            stack.extend(m.data)
    return False


def fuzz_socket(srv: ServerProcess, name: str, group: str, examples: int) -> tuple[int, int]:
    """Send `examples` generated frames, each followed by 3 byte-level mutants of it; return the
    counts of both."""
    [path] = srv.ipc_root.glob(f"msgl-*/{name}")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDTIMEO, 30_000)
    push.connect(f"ipc://{path}")
    sent = [0, 0]
    try:

        @settings(max_examples=examples, **_SETTINGS)
        @given(raw=frame(group, uids=OUTSIDE_API_UIDS), rnd=st.randoms(use_true_random=False))
        def one(raw: bytes, rnd: random.Random) -> None:
            assume(group != "backend" or not _commands_the_server(raw))
            push.send(raw)
            sent[0] += 1
            for m in byte_mutants(raw, rnd, 3):
                if group != "backend" or not _commands_the_server(m):
                    push.send(m)
                    sent[1] += 1

        one()
    finally:
        push.close(linger=5000)
        ctx.term()
    assert_serving(srv)
    return sent[0], sent[1]


def report_frames(fuzz_report, what: str, counts: tuple[int, int]) -> None:
    fuzz_report(f"frames, {what}: generated", counts[0])
    fuzz_report(f"frames, {what}: byte mutants of them", counts[1])


def test_fuzz_http_real_server(server: ServerProcess, fuzz_report) -> None:
    fuzz_report("HTTP bodies, real `minisgl serve --engine dummy`", fuzz_http(server, 200))


def test_fuzz_scheduler_backend_socket(server: ServerProcess, fuzz_report) -> None:
    start = len(server.output())
    counts = fuzz_socket(server, "backend", "backend", 600)
    report_frames(fuzz_report, "scheduler backend input (real server)", counts)
    server.wait_for_log(re.compile("dropped a malformed message from the tokenizer"), start)


def test_fuzz_frontend_reply_socket(server: ServerProcess, fuzz_report) -> None:
    start = len(server.output())
    counts = fuzz_socket(server, "frontend", "frontend", 600)
    report_frames(fuzz_report, "API server reply input (real server)", counts)
    server.wait_for_log(re.compile("dropped a malformed message from the workers"), start)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_real_server_long(server: ServerProcess, fuzz_report) -> None:
    fuzz_report("HTTP bodies, real `minisgl serve --engine dummy`, slow run", fuzz_http(server, 3000))
    counts = fuzz_socket(server, "backend", "backend", 10_000)
    report_frames(fuzz_report, "scheduler backend input (real server), slow run", counts)
    counts = fuzz_socket(server, "frontend", "frontend", 10_000)
    report_frames(fuzz_report, "API server reply input (real server), slow run", counts)

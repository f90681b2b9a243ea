"""The watchdog (issue 22, finding 6): a scheduler rank with work that makes no progress turns /health
503 "stalled" past --stall-timeout and back to 200 when it moves again; past --watchdog-timeout its
threads' stacks are logged, requests in flight end with "abort" and the server exits 1. Before, a
SIGSTOPped scheduler left /health at 200 and requests waiting with no end.

The progress board and the watchdog's rules first (a fake clock), then a real server (the dummy
engine) whose scheduler is stopped with SIGSTOP."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_reliability_procs import Stream, pid_of
from test_server import ServerProcess

from minisgl.launch.watchdog import Watchdog, WatchedRank
from minisgl.utils.progress import ProgressBeat, ProgressBoard, is_busy

pytestmark = pytest.mark.timeout(180)


# ---- the progress board and the watchdog's rules -------------------------------------------------


def test_a_beat_is_seen_by_another_mapping_of_the_board(tmp_path: Path) -> None:
    board = ProgressBoard.create(tmp_path, 3)
    beat = ProgressBeat(ProgressBoard.open(tmp_path), 2)  # the rank's own mapping
    assert [board.read(i) for i in range(3)] == [0, 0, 0]
    beat.beat(True)
    first = board.read(2)
    beat.beat(False)
    assert is_busy(first) and not is_busy(board.read(2)) and board.read(2) != first
    assert board.read(0) == board.read(1) == 0
    with pytest.raises(ValueError, match="slot 3"):
        ProgressBeat(board, 3)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def watched(tmp_path: Path) -> tuple[Watchdog, ProgressBeat, ProgressBeat, Clock]:
    """Two ranks (replicas 0 and 1), --stall-timeout 2, --watchdog-timeout 10."""
    board = ProgressBoard.create(tmp_path, 2)
    clock = Clock()
    ranks = [WatchedRank("scheduler replica 0", 0, 11, 0), WatchedRank("scheduler replica 1", 1, 12, 1)]
    dog = Watchdog(board, ranks, stall_s=2.0, timeout_s=10.0, clock=clock)
    return dog, ProgressBeat(board, 0), ProgressBeat(board, 1), clock


def _names(stalls: list) -> list[str]:
    return [s.rank.name for s in stalls]


def test_a_busy_rank_that_stops_beating_is_stalled_then_expired(watched) -> None:
    dog, beat0, beat1, clock = watched
    beat0.beat(True)
    for _ in range(30):  # replica 0 keeps coming round: never stalled
        clock.t += 0.5
        beat0.beat(True)
        assert dog.poll() == ([], [])
    beat1.beat(True)
    dog.poll()
    clock.t += 1.9
    beat0.beat(True)
    assert dog.poll() == ([], [])
    clock.t += 0.2
    beat0.beat(True)
    stalled, expired = dog.poll()
    assert _names(stalled) == ["scheduler replica 1"] and expired == []
    assert stalled[0].seconds == pytest.approx(2.1) and "pid 12" in stalled[0].describe()
    clock.t += 8.0
    beat0.beat(True)
    stalled, expired = dog.poll()
    assert _names(stalled) == _names(expired) == ["scheduler replica 1"]
    beat1.beat(True)  # it moved again: no longer stalled
    assert dog.poll() == ([], [])


def test_an_idle_rank_is_never_stalled_without_work(watched) -> None:
    dog, beat0, _, clock = watched
    beat0.beat(False)  # about to wait for messages
    dog.poll()
    clock.t += 1000
    assert dog.poll() == ([], [])


def test_an_idle_rank_stalls_from_when_work_arrived_after_its_last_round(watched) -> None:
    """A rank stopped while asleep never says busy: a request accepted after its last round that it
    has not come round for counts, from the time it arrived."""
    dog, beat0, _, clock = watched
    beat0.beat(False)
    dog.poll()
    clock.t += 50
    arrived = clock.t  # a request for replica 0 accepted now
    clock.t += 2.5

    def work_after(replica: int, after: float) -> float | None:
        return arrived if replica == 0 and arrived > after else None

    stalled, expired = dog.poll(work_after)
    assert _names(stalled) == ["scheduler replica 0"] and expired == []
    assert stalled[0].seconds == pytest.approx(2.5)
    beat0.beat(False)  # it woke, took the request, finished it and sleeps again
    assert dog.poll(work_after) == ([], [])  # the request (still in flight here) came before that round


def test_zero_turns_each_part_off(tmp_path: Path) -> None:
    board = ProgressBoard.create(tmp_path, 1)
    clock = Clock()
    rank = [WatchedRank("scheduler", 0, 1, 0)]
    ProgressBeat(board, 0).beat(True)
    only_stall = Watchdog(board, rank, stall_s=1.0, timeout_s=0.0, clock=clock)
    only_watchdog = Watchdog(board, rank, stall_s=0.0, timeout_s=1.0, clock=clock)
    clock.t += 5
    assert [len(x) for x in only_stall.poll()] == [1, 0]
    assert [len(x) for x in only_watchdog.poll()] == [0, 1]
    assert not Watchdog(board, rank, 0.0, 0.0, clock=clock).enabled


# ---- a real server, its scheduler stopped --------------------------------------------------------

STALL_S, WATCHDOG_S = 1.0, 5.0


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The last test of this module ends it (the watchdog fires)."""
    srv = ServerProcess(
        "--engine", "dummy", "--dummy-step-ms", "1", "--max-seq-len", "100000",
        "--stall-timeout", str(STALL_S), "--watchdog-timeout", str(WATCHDOG_S),
    )  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


def _health(url: str) -> tuple[int, dict]:
    r = httpx.get(url + "/health", timeout=5)
    return r.status_code, r.json()


def _wait_health(url: str, status: int, timeout: float) -> tuple[float, dict]:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        code, body = _health(url)
        if code == status:
            return time.monotonic() - start, body
        time.sleep(0.02)
    raise AssertionError(f"/health did not say {status} within {timeout} s")


def test_a_stopped_idle_scheduler_is_stalled_once_a_request_waits_and_recovers(server) -> None:
    pid = pid_of(server, "scheduler")
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(STALL_S + 0.5)
        assert _health(server.url)[0] == 200  # stopped, but no work waits for it: nothing to say
        request = Stream(server.url, 8).start()
        took, body = _wait_health(server.url, 503, WATCHDOG_S)
        print(f"\n/health 503 {took:.2f} s after a request reached the stopped idle scheduler")
        assert body["status"] == "stalled" and f"scheduler (pid {pid}) made no progress" in body["detail"]
    finally:
        os.kill(pid, signal.SIGCONT)
    _wait_health(server.url, 200, 10)
    request.wait_ended(30)
    assert request.finish_reason() == "length", request.lines[-2:]
    assert "scheduler is making progress again" in server.output()


def test_the_watchdog_logs_the_stacks_aborts_and_exits_1(server) -> None:
    """Last in this module: it ends the shared server."""
    streams = [Stream(server.url, 99_000).start() for _ in range(3)]
    for s in streams:
        assert s.first.wait(60) and s.lines, s.error
    pid = pid_of(server, "scheduler")
    start = len(server.output())
    os.kill(pid, signal.SIGSTOP)
    t_stop = time.monotonic()
    to_503, body = _wait_health(server.url, 503, WATCHDOG_S)
    assert body["status"] == "stalled" and "scheduler" in body["detail"], body
    assert server.proc.wait(WATCHDOG_S + 30) == 1
    to_exit = time.monotonic() - t_stop
    print(
        f"\nSIGSTOP of the scheduler: /health 503 after {to_503:.2f} s (--stall-timeout {STALL_S:g}), "
        f"the server exited 1 after {to_exit:.2f} s (--watchdog-timeout {WATCHDOG_S:g})"
    )
    for s in streams:
        s.wait_ended(30)
        assert s.finish_reason() == "abort", (s.lines[-2:], s.error)
    out = server.output()[start:]
    assert re.search(rf"scheduler \(pid {pid}\) made no progress for [\d.]+ s with work waiting "
                     rf"\(--watchdog-timeout {WATCHDOG_S:g}\): the stacks of its threads follow", out), out  # fmt: skip
    stacks = out[out.index("the stacks of its threads follow") :]
    assert re.search(r"Thread 0x[0-9a-f]+ \(most recent call first\)", stacks), stacks
    assert "in run_forever" in stacks, stacks  # the scheduler's main thread, in its loop
    assert "shutting the server down" in stacks
    assert server.stop() == 1 and server.leftovers() == []

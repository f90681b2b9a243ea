"""The launcher's supervision logic with stand-in children: ready, error, death, silence, shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from minisgl.launch.processes import ProcessGroup, StartupError
from minisgl.utils.handshake import send_status

pytestmark = pytest.mark.timeout(60)


# Child entries (module level: the spawn method imports them by name). Each gets its pipe last.
def child_ready(conn) -> None:
    send_status(conn, "ready", {"pid": os.getpid()})
    time.sleep(60)


def child_reports_openmp_env(conn) -> None:
    send_status(conn, "ready", {k: os.environ.get(k) for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")})
    time.sleep(60)


def child_error(conn) -> None:
    send_status(conn, "error", "no model here")


def child_exit(conn) -> None:
    os._exit(3)


def child_silent(conn) -> None:
    time.sleep(60)


def child_ignores_sigterm(conn) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    send_status(conn, "ready", None)
    time.sleep(60)


@pytest.fixture
def group():
    g = ProcessGroup()
    yield g
    g.shutdown(timeout=2.0)


def test_ready_then_death_is_noticed_and_shutdown_leaves_nothing(group: ProcessGroup) -> None:
    a = group.spawn("alpha", child_ready)
    b = group.spawn("beta", child_ready)
    asyncio.run(group.wait_ready([a, b], timeout=30))
    assert a.info["pid"] == a.process.pid
    assert group.first_dead() is None
    os.kill(b.process.pid, signal.SIGKILL)
    b.process.join(5)
    dead = group.first_dead()
    assert dead is b and "killed by signal 9" in dead.describe_exit()
    pids = [a.process.pid, b.process.pid]
    group.shutdown(timeout=2.0)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_startup_failure_names_the_child(group: ProcessGroup) -> None:
    bad = group.spawn("gamma", child_error)
    gone = group.spawn("epsilon", child_exit)
    with pytest.raises(StartupError, match=r"^gamma failed to start: no model here$"):
        asyncio.run(group.wait_ready([bad], timeout=30))
    with pytest.raises(StartupError, match=r"^epsilon exited with code 3 during start-up$"):
        asyncio.run(group.wait_ready([gone], timeout=30))


def test_startup_timeout_or_interrupt_names_the_silent_child(group: ProcessGroup) -> None:
    silent = group.spawn("delta", child_silent)
    with pytest.raises(StartupError, match=r"^delta did not report ready within 2 s$"):
        asyncio.run(group.wait_ready([silent], timeout=2))
    with pytest.raises(StartupError, match="interrupted"):
        asyncio.run(group.wait_ready([silent], timeout=30, cancelled=lambda: True))


def test_stubborn_child_is_killed(group: ProcessGroup) -> None:
    c = group.spawn("stubborn", child_ignores_sigterm)
    asyncio.run(group.wait_ready([c], timeout=30))
    t0 = time.monotonic()
    group.shutdown(timeout=1.0)
    assert c.process.exitcode == -signal.SIGKILL
    assert time.monotonic() - t0 < 10


def test_children_get_short_openmp_spins_unless_the_user_chose(group: ProcessGroup, monkeypatch) -> None:
    """The engine's OpenMP threads sleep soon when they wait (GOMP_SPINCOUNT in the child's
    environment, not the parent's); a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT is left as it is."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    a = group.spawn("alpha", child_reports_openmp_env)
    assert "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    b = group.spawn("beta", child_reports_openmp_env)
    asyncio.run(group.wait_ready([a, b], timeout=30))
    assert a.info == {"GOMP_SPINCOUNT": "1000", "OMP_WAIT_POLICY": None}
    assert b.info == {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": "ACTIVE"}

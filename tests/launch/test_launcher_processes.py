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


def child_reports_env_and_modules(conn) -> None:
    import sys

    send_status(
        conn,
        "ready",
        {
            "pid": os.getpid(),
            "env": os.environ.get("MINISGL_TEST_LATE"),
            "preloaded": "json.tool" in sys.modules,
        },
    )
    time.sleep(60)


def test_a_warm_interpreter_takes_the_job_with_the_launchers_environment(
    group: ProcessGroup, monkeypatch
) -> None:
    """`serve` starts scheduler rank 0's interpreter before it parses its arguments (launch/warm.py):
    the job runs in that process, after its preloads, with the environment as it was at hand-over,
    and reports on the same pipe; a second spawn with the used warm start gets a fresh process."""
    from minisgl.launch.warm import WarmStart

    warm = WarmStart(preload=("json.tool",))
    warm_pid = warm.process.pid
    monkeypatch.setenv("MINISGL_TEST_LATE", "set after the warm start")
    a = group.spawn("rank0", child_reports_env_and_modules, warm=warm)
    b = group.spawn("rank1", child_reports_env_and_modules, warm=warm)
    asyncio.run(group.wait_ready([a, b], timeout=30))
    assert a.info == {"pid": warm_pid, "env": "set after the warm start", "preloaded": True}
    assert b.info["pid"] != warm_pid and b.info["preloaded"] is False
    warm.discard()  # handed over: a no-op
    assert psutil.pid_exists(warm_pid) and group.first_dead() is None


def test_an_unused_warm_interpreter_is_stopped() -> None:
    from minisgl.launch.warm import WarmStart

    warm = WarmStart(preload=())
    pid = warm.process.pid
    assert psutil.pid_exists(pid)
    warm.discard()
    assert warm.process is None
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

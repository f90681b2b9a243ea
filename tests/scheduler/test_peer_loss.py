"""A process whose peer or parent is gone (issue 9, finding 3): timed sends that drop and say so
once, a scheduler that still stops on SIGTERM when its detokenizer is gone, children that stop on
their own when the launcher is killed, and the last one out removing the ipc directory."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.message import BaseBackendMsg, BaseTokenizerMsg, ExitMsg, UserMsg
from minisgl.scheduler import run_scheduler
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils import ZmqAsyncPushQueue, ZmqPullQueue, ZmqPushQueue
from minisgl.utils.handshake import recv_status, send_status

pytestmark = pytest.mark.timeout(120)

MP_LOGGER = "minisgl.utils.mp"


def test_timed_push_without_peer_drops_and_logs_once(ipc_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    addr = f"ipc://{ipc_dir}/nobody"
    push = ZmqPushQueue(addr, create=True, encoder=BaseBackendMsg.encoder, send_timeout_s=0.2)
    try:
        with caplog.at_level(logging.WARNING, logger=MP_LOGGER):
            start = time.monotonic()
            assert push.put(ExitMsg()) is False  # nobody connected: a bound PUSH would block forever
            first = time.monotonic() - start
            assert first >= 0.15
            start = time.monotonic()
            for _ in range(50):
                assert push.put(ExitMsg()) is False
            rest = time.monotonic() - start
        drops = [r for r in caplog.records if "dropping messages" in r.getMessage()]
        assert len(drops) == 1, [r.getMessage() for r in caplog.records]
        assert "no peer took it within 0.2 s" in drops[0].getMessage()
        assert push.total_dropped == 51
        # once dropping, later sends do not wait again (51 waits would take 10 s)
        assert rest < 5, f"50 sends to a dead peer took {rest:.1f} s"
        pull = ZmqPullQueue(addr, create=False, decoder=BaseBackendMsg.decoder)
        try:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger=MP_LOGGER):
                deadline = time.monotonic() + 10
                while not push.put(ExitMsg()):  # dropped without waiting until the connection is up
                    assert time.monotonic() < deadline, "a connected peer never got a message"
                    time.sleep(0.01)
            assert pull.get() == ExitMsg()
            back = [r.getMessage() for r in caplog.records]
            assert back == [f"{addr}: a peer takes messages again; {push.total_dropped} were dropped"], back
        finally:
            pull.stop()
    finally:
        push.stop()


def test_interrupt_ends_a_waiting_send(ipc_dir: Path) -> None:
    push = ZmqPushQueue(f"ipc://{ipc_dir}/x", create=True, encoder=BaseBackendMsg.encoder, send_timeout_s=60)
    threading.Timer(0.3, push.interrupt).start()
    start = time.monotonic()
    try:
        assert push.put(ExitMsg()) is False
        assert time.monotonic() - start < 30  # interrupted, not the 60 s timeout
        assert push.put(ExitMsg()) is False  # and no later send waits
    finally:
        push.stop()


def test_untimed_push_still_queues_for_a_late_peer(ipc_dir: Path) -> None:
    """Without a timeout the chapters' semantics hold: a connected PUSH queues until a peer binds."""
    addr = f"ipc://{ipc_dir}/late"
    push = ZmqPushQueue(addr, create=False, encoder=BaseBackendMsg.encoder)
    assert push.put(ExitMsg()) is True
    pull = ZmqPullQueue(addr, create=True, decoder=BaseBackendMsg.decoder)
    try:
        assert pull.poll(10) and pull.get() == ExitMsg()
    finally:
        push.stop()
        pull.stop()


def test_async_push_without_peer_raises_timeout(ipc_dir: Path) -> None:
    push = ZmqAsyncPushQueue(
        f"ipc://{ipc_dir}/a", create=True, encoder=BaseTokenizerMsg.encoder, send_timeout_s=0.2
    )

    async def send() -> None:
        from minisgl.message import AbortMsg

        await push.put(AbortMsg(uid=1))

    try:
        with pytest.raises(TimeoutError, match="no peer took the message within 0.2 s"):
            asyncio.run(asyncio.wait_for(send(), 30))
    finally:
        push.stop()


def test_last_one_out_removes_the_ipc_dir(tmp_path: Path) -> None:
    from minisgl.utils.ipc import IpcDirLease

    d = tmp_path / "msgl-x"
    d.mkdir()
    (d / "backend").write_text("")
    a, b = IpcDirLease(d), IpcDirLease(d)
    assert a.leave() is False and d.is_dir()  # b still holds a share
    assert a.leave() is False  # idempotent
    assert b.leave() is True and not d.exists()


# ---- a scheduler process whose detokenizer is gone -----------------------------------------------


def test_scheduler_stops_on_sigterm_when_its_detokenizer_is_gone(
    ipc_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler binds its PUSH to the detokenizer; with the detokenizer gone, a send has no
    peer. Before the fix the send blocked forever, so the scheduler never read the ExitMsg its
    SIGTERM handler queued and had to be killed."""
    monkeypatch.setenv("MINISGL_IPC_ROOT", str(ipc_dir))
    config = SchedulerConfig(
        model_path="/nonexistent/model",
        tp_info=DistributedInfo(0, 1),
        dtype=torch.float32,
        engine="dummy",
        max_seq_len=100_000,
    )
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=run_scheduler, args=(config, child), daemon=True)
    proc.start()
    push = ZmqPushQueue(config.zmq_backend_addr, create=False, encoder=BaseBackendMsg.encoder)
    try:
        assert parent.poll(60) and recv_status(parent)[0] == "ready"
        pull = ZmqPullQueue(config.zmq_detokenizer_addr, create=False, decoder=BaseTokenizerMsg.decoder)
        ids = torch.tensor([1, 2, 3], dtype=torch.int32)
        push.put(UserMsg(1, ids, SamplingParams(max_tokens=99_000, ignore_eos=True)))
        assert pull.poll(30)  # it is generating
        pull.stop()  # the detokenizer dies
        time.sleep(0.5)  # the scheduler is now waiting in a send with no peer
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(20)
        assert proc.exitcode == 0, "the scheduler did not stop within 20 s of SIGTERM"
    finally:
        push.stop()
        if proc.is_alive():
            proc.kill()
        config.remove_ipc_dir()


def wait_gone(procs: list[psutil.Process], timeout: float) -> float:
    """Seconds until every process has exited (a zombie waiting for its new parent to reap it
    counts as exited); AssertionError naming the survivors after `timeout`."""
    start = time.monotonic()
    alive = list(procs)
    while alive:
        alive = [p for p in alive if _running(p)]
        if alive and time.monotonic() - start > timeout:
            raise AssertionError(f"still running {timeout:g} s later: {[p.pid for p in alive]}")
        time.sleep(0.02)
    return time.monotonic() - start


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- children of a killed launcher -----------------------------------------------------------------


def child_sleeps(conn) -> None:
    send_status(conn, "ready")
    time.sleep(120)


def child_ignores_sigterm(conn) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    send_status(conn, "ready")
    time.sleep(120)


def fake_launcher(ipc_dir: str) -> None:
    """A launcher stand-in (run in its own process): two children, then wait to be killed."""
    from minisgl.launch.processes import ProcessGroup

    group = ProcessGroup(ipc_dir, parent_death_grace_s=1.0)
    kids = [group.spawn("sleeper", child_sleeps), group.spawn("stubborn", child_ignores_sigterm)]
    asyncio.run(group.wait_ready(kids, 120))
    print(" ".join(str(k.process.pid) for k in kids), flush=True)
    time.sleep(120)


def test_children_of_a_killed_launcher_stop_and_the_last_removes_the_ipc_dir(tmp_path: Path) -> None:
    """kill -9 of the launcher: every child is gone within a few seconds (one that ignores SIGTERM
    included, after the grace period), and the last one out removed the ipc directory."""
    ipc = tmp_path / "msgl-srv"
    ipc.mkdir(mode=0o700)
    (ipc / "tokenizer").write_text("")  # a socket file the dead launcher left
    code = f"import sys; sys.path[:0] = {os.environ['MINISGL_TEST_DIRS']!r}.split({os.pathsep!r}); import test_peer_loss as t; t.fake_launcher({str(ipc)!r})"
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    kids: list[psutil.Process] = []
    try:
        line = launcher.stdout.readline() if launcher.stdout else ""
        kids = [psutil.Process(int(pid)) for pid in line.split()]
        assert len(kids) == 2, line
        launcher.kill()
        launcher.wait(10)
        took = wait_gone(kids, timeout=15)
        print(f"children gone {took:.1f} s after the launcher was killed")
        deadline = time.monotonic() + 5
        while ipc.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not ipc.exists(), list(ipc.iterdir())
    finally:
        launcher.kill()
        for p in kids:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass

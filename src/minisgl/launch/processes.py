"""The launcher's children: start them (spawn), wait for each to report ready, notice a death, and
stop them all without leaving an orphan behind.

Each child gets the sending end of a Pipe and reports ("ready", info) or ("error", why) on it. A
child that exits, reports an error or stays silent past the deadline makes start-up fail with a
message naming it."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

from minisgl.launch.child import Lifeline, child_main
from minisgl.launch.warm import WarmStart
from minisgl.utils.handshake import recv_status
from minisgl.utils.host import quiet_openmp_waits

logger = logging.getLogger("minisgl.launcher")

_POLL_S = 0.05


class StartupError(RuntimeError):
    """A child failed to start; the message names it."""


@dataclass
class Child:
    name: str
    process: BaseProcess
    conn: Connection  # the launcher's end of the child's pipe
    info: Any = None

    def describe_exit(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "is running"
        return f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"


class ProcessGroup:
    """Children started with the spawn method (safe with threads, CUDA and ZMQ in the parent).

    Each child watches for this process's death and stops on its own (`child.Lifeline`); with
    `ipc_dir`, the last process of the server to exit removes that directory."""

    def __init__(self, ipc_dir: str | None = None, parent_death_grace_s: float = 5.0) -> None:
        self.ctx = mp.get_context("spawn")
        self.children: list[Child] = []
        self.lifeline = Lifeline(os.getpid(), ipc_dir, grace_s=parent_death_grace_s)

    def spawn(
        self, name: str, target: Callable[..., object], *args: object, warm: WarmStart | None = None
    ) -> Child:
        """Start `target(*args, status_pipe)` in `warm`'s interpreter if still unused (warm.py), else anew."""
        if warm is not None and warm.process is not None:
            proc, parent_end = warm.hand(self.lifeline, target, args)
        else:
            parent_end, child_end = self.ctx.Pipe(duplex=True)
            proc = self.ctx.Process(
                target=child_main, args=(self.lifeline, target, *args, child_end), name=name, daemon=False
            )
            with quiet_openmp_waits():  # the child's environment, not this process's
                proc.start()
            child_end.close()
        child = Child(name, proc, parent_end)
        self.children.append(child)
        logger.info("started %s (pid %d)", name, proc.pid)
        return child

    async def wait_ready(
        self, children: Sequence[Child], timeout: float, cancelled: Callable[[], bool] = lambda: False
    ) -> None:
        """Wait until every child in `children` reported ready; raise StartupError naming the first
        that failed, died or timed out."""
        deadline = time.monotonic() + timeout
        pending = list(children)
        while pending := self._still_pending(pending, deadline, timeout, cancelled):
            await asyncio.sleep(_POLL_S)

    def wait_ready_blocking(self, children: Sequence[Child], timeout: float) -> None:
        """`wait_ready` for a caller without an event loop (the offline LLM; also inside Jupyter's)."""
        deadline = time.monotonic() + timeout
        pending = list(children)
        while pending := self._still_pending(pending, deadline, timeout, lambda: False):
            time.sleep(_POLL_S)

    def _still_pending(
        self, pending: list[Child], deadline: float, timeout: float, cancelled: Callable[[], bool]
    ) -> list[Child]:
        """The children not ready yet; StartupError for a failure, an interruption or the deadline."""
        pending = [c for c in pending if not self._check_one(c)]
        if pending and cancelled():
            raise StartupError("start-up interrupted")
        if pending and time.monotonic() > deadline:
            names = ", ".join(c.name for c in pending)
            raise StartupError(f"{names} did not report ready within {timeout:g} s")
        return pending

    @staticmethod
    def _check_one(child: Child) -> bool:
        if child.conn.poll():
            try:
                kind, payload = recv_status(child.conn)
            except (EOFError, OSError):
                child.process.join(1.0)
                raise StartupError(f"{child.name} {child.describe_exit()} during start-up") from None
            if kind == "ready":
                child.info = payload
                return True
            raise StartupError(f"{child.name} failed to start: {payload}")
        if not child.process.is_alive():
            raise StartupError(f"{child.name} {child.describe_exit()} during start-up")
        return False

    def first_dead(self) -> Child | None:
        for child in self.children:
            if child.process.exitcode is not None:
                return child
        return None

    def shutdown(self, timeout: float = 5.0) -> None:
        """SIGTERM every child (and anything it started), wait, then SIGKILL what is left.

        Children are reaped through multiprocessing (so their exit codes stay readable); their own
        descendants, if any, through psutil."""
        descendants: list[psutil.Process] = []
        for child in self.children:
            if child.process.exitcode is None and child.process.pid is not None:
                try:
                    descendants.extend(psutil.Process(child.process.pid).children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
                child.process.terminate()
        for p in descendants:
            _signal_quietly(p, psutil.Process.terminate)
        deadline = time.monotonic() + timeout
        for child in self.children:
            child.process.join(max(0.0, deadline - time.monotonic()))
            if child.process.exitcode is None:
                logger.warning(
                    "%s (pid %d) did not stop in %g s: killing it", child.name, child.process.pid, timeout
                )
                child.process.kill()
                child.process.join(timeout)
        _, alive = psutil.wait_procs(descendants, timeout=max(0.0, deadline - time.monotonic()))
        for p in alive:
            _signal_quietly(p, psutil.Process.kill)
        for child in self.children:
            child.conn.close()


def _signal_quietly(p: psutil.Process, how: Callable[[psutil.Process], None]) -> None:
    try:
        how(p)
    except psutil.NoSuchProcess:
        pass

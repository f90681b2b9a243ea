"""A scheduler's interpreter started before its job is known.

A server is ready when its scheduler is, and most of a scheduler's start-up on a CPU machine is
`import torch` (2-3 s on a 2-core box). `minisgl serve` therefore spawns one interpreter first of all,
before it parses its arguments, resolves the model and imports the launcher; that interpreter
imports torch and the scheduler's modules while the launcher does the rest, then waits on its pipe.
The launcher hands it scheduler rank 0's job (`ProcessGroup.spawn(..., warm=...)`): the launcher's
environment as it is by then, the child's lifeline, the entry and its arguments; from there on it is
an ordinary child (`child.child_main`), reporting on the same pipe. If the launcher stops before
handing it a job (bad arguments, a busy port) it terminates the interpreter (`discard`); if the
launcher dies, the pipe's end wakes the interpreter, which exits.

This module stays import-light: the launcher imports it before anything else."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from minisgl.utils.host import quiet_openmp_waits

PRELOAD = ("torch", "minisgl.scheduler.scheduler")


class WarmStart:
    """One spawned interpreter importing `preload`, waiting for a job."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_end = ctx.Pipe(duplex=True)
        self.process: BaseProcess | None = ctx.Process(
            target=warm_main, args=(child_end, preload), name="warm-start", daemon=False
        )
        with quiet_openmp_waits():  # the same environment a child spawned later gets
            self.process.start()
        child_end.close()

    def hand(
        self, lifeline: Any, target: Callable[..., object], args: tuple[Any, ...]
    ) -> tuple[BaseProcess, Connection]:
        """Give the interpreter its job; return it and the launcher's end of its status pipe."""
        if self.process is None:
            raise RuntimeError("this warm interpreter has been handed a job or discarded already")
        process, self.process = self.process, None
        self.conn.send((dict(os.environ), lifeline, target, args))
        return process, self.conn

    @property
    def available(self) -> bool:
        return self.process is not None and self.process.exitcode is None

    def discard(self) -> None:
        """Stop the interpreter if it was never handed a job (a no-op after `hand`)."""
        if self.process is None:
            return
        process, self.process = self.process, None
        process.terminate()
        process.join(5.0)
        if process.exitcode is None:
            process.kill()
            process.join()
        self.conn.close()


def warm_main(conn: Connection, preload: tuple[str, ...]) -> None:
    """The interpreter's entry: import, wait for the job, run it as a child of the launcher."""
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # the job's own imports report the failure, with its message
            break
    try:
        env, lifeline, target, args = conn.recv()
    except (EOFError, OSError):  # the launcher stopped or died before it had a job for us
        os._exit(0)
    os.environ.update(env)
    from minisgl.launch.child import child_main
    from minisgl.utils.logger import apply_level_from_env

    apply_level_from_env()

    child_main(lifeline, target, *args, conn)

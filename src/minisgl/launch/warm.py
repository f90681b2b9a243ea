"""Scheduler rank 0's interpreter, started before its job is known: most of a CPU server's start-up
is the scheduler's `import torch`, so `minisgl serve` spawns this first of all (import-light module);
it imports torch and the scheduler while the launcher parses, resolves the model and imports its own
modules, then takes its job over its pipe (`ProcessGroup.spawn(..., warm=...)`) with the launcher's
environment as it is by then, and runs as an ordinary child reporting on that pipe. Never handed a
job, it is terminated (`discard`), or exits when the launcher's end of the pipe closes."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from minisgl.utils.host import quiet_openmp_waits


class WarmStart:
    """One spawned interpreter importing `preload`, waiting for a job."""

    def __init__(self, preload: tuple[str, ...] = ("torch", "minisgl.scheduler.scheduler")) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_end = ctx.Pipe(duplex=True)
        self.process: BaseProcess | None = ctx.Process(target=warm_main, args=(child_end, preload))
        with quiet_openmp_waits():  # the environment a child spawned later gets
            self.process.start()
        child_end.close()

    def hand(
        self, lifeline: Any, target: Callable[..., object], args: tuple
    ) -> tuple[BaseProcess, Connection]:
        """Give the interpreter its job; return it and the launcher's end of its status pipe."""
        assert self.process is not None, "handed a job or discarded already"
        process, self.process = self.process, None
        self.conn.send((dict(os.environ), lifeline, target, args))
        return process, self.conn

    def discard(self) -> None:
        """Stop the interpreter unless it was handed a job."""
        if self.process is not None:
            process, self.process = self.process, None
            process.terminate()  # no handler of its own before it has a job: SIGTERM ends it
            process.join()
            self.conn.close()


def warm_main(conn: Connection, preload: tuple[str, ...]) -> None:
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # the job's own imports report it, with their message
            break
    try:
        env, lifeline, target, args = conn.recv()
    except (EOFError, OSError):  # the launcher stopped or died before it had a job for us
        os._exit(0)
    os.environ.update(env)
    from minisgl.launch.child import child_main
    from minisgl.utils.logger import apply_level_from_env

    apply_level_from_env()  # the modules imported above set up logging before the environment came
    child_main(lifeline, target, *args, conn)

"""The SIGTERM handler of minisgl's processes, and the signal that dumps a process's stacks."""

from __future__ import annotations

import faulthandler
import signal
import sys
from types import FrameType

# A process that called `dump_stacks_on_signal()` writes every thread's Python stack to stderr (the
# server's log) when it gets this signal; the launcher sends it to a scheduler rank its watchdog
# gives up on. faulthandler writes from the C signal handler: it works while the main thread is
# stuck in C code or holds the GIL.
STACKS_SIGNAL = signal.SIGUSR1


def raise_exit(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001 (a handler's signature)
    """Leave through SystemExit(0), so that `finally` blocks and context managers close what is open."""
    raise SystemExit(0)


def dump_stacks_on_signal() -> None:
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)

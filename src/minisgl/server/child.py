"""What every child process of the launcher runs first (kept import-light: it runs before the
child's real entry is imported).

The child dies with the launcher even if the launcher is killed with SIGKILL (Linux parent-death
signal), and ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and the launcher
alone decides how to stop (it sends SIGTERM to each child). Logging goes to stderr (inherited from
the launcher) at the level the launcher put in MINISGL_LOG_LEVEL."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return  # best effort: the launcher still stops its children on every normal exit
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the launcher died before prctl
        os._exit(1)


def child_main(target: Callable[..., Any], *args: Any) -> None:
    from minisgl.utils.logger import init_logger

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    init_logger("minisgl")  # one stderr handler for the minisgl tree, level from MINISGL_LOG_LEVEL
    target(*args)

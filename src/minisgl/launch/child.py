"""What every child process of the launcher runs first (kept import-light: it runs before the
child's real entry is imported).

Parent death. A child must not outlive the launcher (a killed launcher used to leave a 1.9 GB
scheduler and the ipc directory behind). Two watches, because neither alone is enough:
  - Linux: `prctl(PR_SET_PDEATHSIG, SIGTERM)`: the kernel sends SIGTERM the moment the launcher dies;
  - everywhere: a thread polling `os.getppid()`, which changes when the child is re-parented. It
    sends the SIGTERM itself where prctl is missing, and in every case ends the process with
    `os._exit` if it is still alive `grace_s` after the launcher's death (a child stuck in C code).
Until the child's entry installs its own SIGTERM handler, SIGTERM raises SystemExit, so even a child
that is still importing or loading cleans up on its way out.

The last one out removes the ipc directory: each child holds a share of it (`IpcDirLease`) and gives
it up as it exits; the kernel drops a dead process's share however it died.

SIGINT is ignored: Ctrl-C in a terminal reaches the whole process group, and the launcher alone
decides how to stop (it drains, then sends SIGTERM to each child). Logging goes to stderr
(inherited from the launcher) at the level the launcher put in MINISGL_LOG_LEVEL."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from minisgl.utils.ipc import IpcDirLease
from minisgl.utils.profiling import maybe_profile
from minisgl.utils.signals import raise_exit

logger = logging.getLogger("minisgl.child")

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Lifeline:
    """What a child needs to notice the launcher's death and to clean up after it."""

    parent_pid: int
    ipc_dir: str | None = None  # the server's socket directory (None: nothing to clean up)
    poll_s: float = 0.25  # how often the portable watch looks at os.getppid()
    grace_s: float = 5.0  # after the launcher died, how long a clean stop may take before os._exit


def _set_pdeathsig() -> bool:
    """Ask the kernel for SIGTERM when the launcher dies; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(lifeline: Lifeline, lease: IpcDirLease | None, kernel_signals: bool) -> None:
    """Wait for the launcher's death; then stop this process (see the module docstring)."""
    while os.getppid() == lifeline.parent_pid:
        time.sleep(lifeline.poll_s)
    logger.warning("the launcher (pid %d) is gone: stopping", lifeline.parent_pid)
    if not kernel_signals:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(lifeline.grace_s)
    logger.error("still running %g s after the launcher died: exiting now", lifeline.grace_s)
    if lease is not None:
        lease.leave()
    os._exit(1)


def child_main(lifeline: Lifeline, target: Callable[..., object], *args: object) -> None:
    from minisgl.utils.logger import init_logger

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, raise_exit)
    init_logger("minisgl")  # one stderr handler for the minisgl tree, level from MINISGL_LOG_LEVEL
    try:
        lease = IpcDirLease(lifeline.ipc_dir) if lifeline.ipc_dir else None
    except FileNotFoundError:  # the launcher is gone and so is its directory
        os._exit(1)
    kernel_signals = _set_pdeathsig()
    if os.getppid() != lifeline.parent_pid:  # the launcher died before prctl: no signal will come
        kernel_signals = False
    watch = threading.Thread(
        target=_watch_parent, args=(lifeline, lease, kernel_signals), name="parent-watch", daemon=True
    )
    watch.start()
    try:
        with maybe_profile(getattr(target, "__name__", "child")):
            target(*args)
    finally:
        if lease is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut this short
            lease.leave()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # A clean stop (the entry returned and closed what it opened): leave without the interpreter's
    # finalization, where pyzmq's clean-up was seen spinning in the tokenizer workers for longer than
    # the launcher waits for a child.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""What this machine lends a server: a free TCP port, and the directory for caches."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (a `tcp://` rendezvous, a child server's HTTP port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ip_facing(host: str) -> str:
    """This machine's address on the interface that reaches `host` (no packet is sent): what a rank on
    another machine than node 0 binds, rather than every interface."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def cache_dir() -> Path:
    """Where converted GGUF models and built kernels are kept: $MINISGL_CACHE_DIR, else
    ~/.cache/minisgl (not created here)."""
    env = os.environ.get("MINISGL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "minisgl"


def release_free_memory() -> bool:
    """Hands the C heap's free pages back to the OS (glibc's malloc_trim): a busy step's scratch
    (prefill activations, kernel buffers) otherwise stays resident after the work ends. False where
    the C library has no malloc_trim (not glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, looked up once among the symbols the process already has (no
    ctypes.util.find_library: it runs `ldconfig -p` in a subprocess at every call)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def set_cpus(pids: list[int], cpus: set[int]) -> None:
    """Every thread of the processes `pids` (0: this one) to `cpus` (Linux; a no-op elsewhere, and
    for a process that is gone). Threads inherit their creator's set, so each one is set."""
    if not hasattr(os, "sched_setaffinity"):
        return
    for tid in _threads(pids):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass


def lower_priority(pids: list[int], niceness: int) -> None:
    """Every thread of the processes `pids` (0: this one) to at least `niceness` (Linux keeps a nice
    value per thread; threads made later inherit their creator's). It only ever raises a thread's
    niceness: that needs no privilege, lowering it does. A no-op off Linux and for a process that is
    gone."""
    if not hasattr(os, "setpriority"):
        return
    for tid in _threads(pids):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError:
            pass


def _threads(pids: list[int]) -> list[int]:
    """The thread ids of the processes `pids` (0: this one) that are still there (Linux's /proc;
    none elsewhere)."""
    tids: list[int] = []
    for pid in pids:
        try:
            tids += [int(t) for t in os.listdir(f"/proc/{pid or os.getpid()}/task")]
        except OSError:
            continue
    return tids


def keep_to_few_cpus(pids: list[int]) -> Callable[[], None]:
    """Every thread of `pids` (0: this process) to the last len(pids) - 1 of this process's CPUs (at
    least one, at most all but one), for a while: on 2 cores a server's start-up otherwise shares
    both between three processes. Returns what gives them all of this process's CPUs back. With one
    CPU, or off Linux, nothing happens."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return lambda: None
    set_cpus(pids, set(cpus[-max(1, min(len(pids) - 1, len(cpus) - 1)) :]))
    return lambda: set_cpus(pids, set(cpus))


# libgomp spins this many rounds at a barrier before it sleeps (its default, 300,000, is milliseconds).
OPENMP_SPIN_ROUNDS = "1000"


@contextlib.contextmanager
def quiet_openmp_waits() -> Iterator[None]:
    """While it lasts, processes started from this one have OpenMP threads (the engine's kernels,
    through torch's libgomp) that sleep soon when they wait, unless OMP_WAIT_POLICY or GOMP_SPINCOUNT
    is set already. A decode step ends a few hundred parallel regions in barriers; with libgomp's long
    default spin a waiting thread holds its core while the thread it waits for was preempted by
    another program, and decode on a busy 2-core machine fell to a fifth of its speed
    (docs/benchmarks.md). libgomp reads it when it loads, so it is set for children, before they
    import torch; this process's environment is restored."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        yield
        return
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_ROUNDS
    try:
        yield
    finally:
        os.environ.pop("GOMP_SPINCOUNT", None)

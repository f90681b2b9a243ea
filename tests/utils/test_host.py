"""Host helpers: the CPU sets a server's start-up narrows and gives back, the niceness its front end
takes, the C heap given back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minisgl.utils.host import keep_to_few_cpus, lower_priority

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU sets")


def test_keep_to_few_cpus_narrows_every_thread_then_gives_all_back() -> None:
    child = _threads_child()
    try:
        cpus = sorted(os.sched_getaffinity(0))

        def sets() -> list[set[int]]:
            return [os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{child.pid}/task")]

        give_back = keep_to_few_cpus([child.pid, 999_999_999])  # a pid that is gone is skipped
        want = set(cpus[-1:]) if len(cpus) > 1 else set(cpus)
        assert sets() == [want] * 4
        give_back()
        assert sets() == [set(cpus)] * 4
    finally:
        child.kill()
        child.wait()


def _threads_child() -> subprocess.Popen:
    threads = (
        "import threading, time; [threading.Thread(target=time.sleep, args=(60,)).start() for _ in range(3)]"
    )
    child = subprocess.Popen([sys.executable, "-c", threads + "; time.sleep(60)"])
    while len(os.listdir(f"/proc/{child.pid}/task")) < 4:
        pass
    return child


def test_lower_priority_reaches_every_thread_and_never_raises_priority() -> None:
    child = _threads_child()
    try:

        def nices() -> list[int]:
            return [os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{child.pid}/task")]

        base = os.getpriority(os.PRIO_PROCESS, 0)
        want = max(base, 7)
        lower_priority([child.pid, 999_999_999], 7)  # a pid that is gone is skipped
        assert nices() == [want] * 4
        lower_priority([child.pid], 3)  # lower than it is: left alone (and unprivileged, impossible)
        assert nices() == [want] * 4
    finally:
        child.kill()
        child.wait()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_release_free_memory_gives_back_freed_heap_without_a_subprocess(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Freed blocks below a live one stay resident until malloc_trim; the lookup of malloc_trim runs
    no `ldconfig` (ctypes.util.find_library would, at every idle spell of the scheduler)."""
    import ctypes

    from minisgl.utils import host

    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError("release_free_memory started a subprocess")

    monkeypatch.setattr(subprocess.Popen, "__init__", no_subprocess)
    host._malloc_trim.cache_clear()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 << 10  # under glibc's mmap threshold: from the heap
    blocks = [libc.malloc(size) for _ in range(400)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks[::2]:  # every other one: live blocks between them keep free() from shrinking the heap
        libc.free(b)
    before = _rss_bytes()
    assert host.release_free_memory() is True
    after = _rss_bytes()
    for b in blocks[1::2]:
        libc.free(b)
    assert before - after > 8 << 20, (before, after)  # most of the 12.5 MiB freed went back

"""Host helpers: the CPU sets a server's start-up narrows and gives back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minisgl.utils.host import keep_to_few_cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU sets")


def test_keep_to_few_cpus_narrows_every_thread_then_gives_all_back() -> None:
    threads = (
        "import threading, time; [threading.Thread(target=time.sleep, args=(60,)).start() for _ in range(3)]"
    )
    child = subprocess.Popen([sys.executable, "-c", threads + "; time.sleep(60)"])
    try:
        while len(os.listdir(f"/proc/{child.pid}/task")) < 4:
            pass
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

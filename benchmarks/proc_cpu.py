"""CPU use of a process and its children while a benchmark runs: one line per process (pid, name,
average CPU % over the window, where 100 is one core busy all the time).

    python benchmarks/proc_cpu.py PID --seconds 20
"""

from __future__ import annotations

import argparse
import time

import psutil


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pid", type=int)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--delay", type=float, default=0.0, help="wait this long before measuring")
    ns = ap.parse_args()
    time.sleep(ns.delay)
    root = psutil.Process(ns.pid)
    procs = [root, *root.children(recursive=True)]
    start = {p.pid: p.cpu_times() for p in procs}
    time.sleep(ns.seconds)
    for p in procs:
        try:
            now = p.cpu_times()
            used = (now.user + now.system) - (start[p.pid].user + start[p.pid].system)
            cmd = " ".join(p.cmdline()[-3:])[-60:]
            print(f"pid {p.pid:7d} {100 * used / ns.seconds:6.1f}% cpu  threads {p.num_threads():3d}  {cmd}")
        except psutil.NoSuchProcess:
            print(f"pid {p.pid:7d} gone")


if __name__ == "__main__":
    main()

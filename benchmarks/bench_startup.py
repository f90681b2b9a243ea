"""Start-up of `minisgl serve` from two checkouts (their virtualenvs' pythons), alternated: wall time
to /health 200, the CPU seconds of the whole process tree by then (steadier than wall time on a
shared machine), and the summed RSS at that moment. Each side's min and median over --rounds.

    python benchmarks/bench_startup.py --python /work/main/.venv/bin/python --python .venv/bin/python
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import time

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(python: str, extra: list[str]) -> tuple[float, float, float]:
    """(seconds to /health 200, CPU seconds of the process tree, summed RSS MiB) of one start."""
    port = free_port()
    cmd = [python, "-m", "minisgl", "serve", "--port", str(port), "--log-level", "warning", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.01)
        wall = time.perf_counter() - t0
        root = psutil.Process(proc.pid)
        cpu = rss = 0.0
        for p in [root, *root.children(recursive=True)]:
            t = p.cpu_times()
            cpu += t.user + t.system
            rss += p.memory_info().rss / 2**20
        return wall, cpu, rss
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", action="append", required=True, help="a checkout's python (give two)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("extra", nargs="*", help="more `minisgl serve` arguments (after --)")
    ns = ap.parse_args()
    runs: dict[str, list[tuple[float, float, float]]] = {py: [] for py in ns.python}
    for _ in range(ns.rounds):
        for py in ns.python:
            runs[py].append(start_once(py, ns.extra))
    for py, rs in runs.items():
        wall, cpu, rss = ([r[i] for r in rs] for i in range(3))
        print(
            f"{py}: wall min {min(wall):.2f} s, median {statistics.median(wall):.2f}; CPU-s min {min(cpu):.2f}, "
            f"median {statistics.median(cpu):.2f}; RSS at /health min {min(rss):.0f} MiB"
        )


if __name__ == "__main__":
    main()

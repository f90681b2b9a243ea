"""Two "machines" on 127.0.0.1 (two `minisgl serve` commands, --nnodes 2, the dummy engine): a
tensor-parallel group spanning both serves and stops cleanly with node 0; a replica on node 1
(reached over tcp) serves, and a rank killed there brings both nodes down with an error naming it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import psutil
import pytest
from test_server import ServerProcess, free_port, server_files

pytestmark = pytest.mark.timeout(240)


class Node1:
    """`minisgl serve --node-rank 1 ...` in the background (no HTTP), its output in a file."""

    def __init__(self, *args: str) -> None:
        self.ipc_root, self.log_path = server_files("msgl-n")
        with open(self.log_path, "wb") as log:
            env = {**os.environ, "MINISGL_IPC_ROOT": str(self.ipc_root)}
            cmd = [sys.executable, "-m", "minisgl", "serve", "--node-rank", "1", *args]
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pid_of(self, name: str) -> int:
        m = re.search(rf"started {re.escape(name)} \(pid (\d+)\)", self.output())
        assert m, self.output()
        return int(m.group(1))

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def _two_nodes(*args: str) -> tuple[ServerProcess, Node1]:
    common = ("--engine", "dummy", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}", *args)
    node1 = Node1(*common)
    try:
        node0 = ServerProcess(*common, "--node-rank", "0", startup_timeout=120)
    except BaseException:
        node1.proc.kill()
        raise
    return node0, node1


def _complete(url: str) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_tp_group_across_two_nodes_serves_and_stops_cleanly() -> None:
    node0, node1 = _two_nodes("--tp", "2")
    try:
        kids = node1.children()
        out = _complete(node0.url)
        assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 5
        assert "started scheduler rank 1" in node1.output()  # rank 1 runs on node 1
        assert "started scheduler rank 1" not in node0.output()
        assert node0.stop() == 0
        assert node1.wait() == 0
        assert "node 0 stopped" in node1.output()
    finally:
        node0.stop()
        node1.proc.kill()
    assert node0.orphans == []
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert alive == []


def test_a_rank_killed_on_node_1_brings_both_down() -> None:
    """--dp 2: replica 1 lives on node 1 (its pipes to node 0's tokenizer are tcp); it serves; then
    kill -9 of its scheduler: node 1 exits 1 naming it, and node 0 exits 1 saying so."""
    node0, node1 = _two_nodes("--dp", "2")
    try:
        outs = [_complete(node0.url) for _ in range(4)]
        assert all(o["usage"]["completion_tokens"] == 5 for o in outs)
        text = httpx.get(node0.url + "/metrics", timeout=10).text
        assert 'minisgl_replica_requests_routed_total{replica="1"} 2.0' in text  # round robin when idle
        psutil.Process(node1.pid_of("scheduler replica 1")).send_signal(signal.SIGKILL)
        assert node1.wait(30) == 1
        assert "scheduler replica 1 was killed by signal 9" in node1.output()
        assert node0.proc.wait(30) == 1
        assert "node 1: scheduler replica 1 was killed by signal 9" in node0.output()
    finally:
        node0.stop()
        node1.proc.kill()
    assert node0.orphans == []


@pytest.mark.slow  # the single-machine watchdog is tested fast in test_watchdog.py
def test_a_stopped_rank_on_node_1_is_ended_by_its_watchdog() -> None:
    """Replica 1 on node 1, SIGSTOPped with a stream in flight: node 1's watchdog logs its stacks and
    fails node 1, node 0 stops the server (exit 1) and the stream ends with "abort"."""
    from test_reliability_procs import Stream

    node0, node1 = _two_nodes(
        "--dp", "2", "--dummy-step-ms", "1", "--max-seq-len", "100000", "--watchdog-timeout", "3"
    )
    try:
        streams = [Stream(node0.url, 99_000).start() for _ in range(2)]  # one on each replica
        for s in streams:
            assert s.first.wait(60) and s.lines, s.error
        pid = node1.pid_of("scheduler replica 1")
        os.kill(pid, signal.SIGSTOP)
        assert node1.wait(60) == 1
        assert node0.proc.wait(30) == 1
        for s in streams:
            s.wait_ended(30)
            assert s.finish_reason() == "abort", s.lines[-2:]
        out = node1.output()
        assert f"scheduler replica 1 (pid {pid}) made no progress" in out and "in run_forever" in out, out
        assert "--watchdog-timeout 3" in node0.output(), node0.output()
    finally:
        node0.stop()
        node1.proc.kill()

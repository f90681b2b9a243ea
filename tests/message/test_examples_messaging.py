"""The messaging chapters' example programs run and print what the chapters show."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, ipc_dir: Path, timeout: int) -> str:
    env = {**os.environ, "MINISGL_IPC_ROOT": str(ipc_dir)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(120)
def test_ch12_message(ipc_dir: Path) -> None:
    out = run_example("ch12_message.py", ipc_dir, 100)
    assert "'__type__': 'UserMsg', 'uid': 7" in out
    # SamplingParams grew with issue 25 (embed, the reasoning token ids, return_token_ids): 394 before
    assert "457 bytes after msgpack; to_bytes() gives the same bytes: True" in out
    assert "decoded back: 7 tensor([9707,   11, 1879], dtype=torch.int32)" in out
    assert "a 2-D tensor round trip: [[0, 1, 2], [3, 4, 5]]" in out
    assert "rejected: backend message: unknown backend message type 'Evil'" in out
    assert "rejected: AbortBackendMsg.uid: expected int, got str '7'" in out
    assert "PULL received uid: [0, 1, 2]  queue empty: True" in out
    assert "both SUBs received it: [7, 7]" in out


@pytest.mark.timeout(180)
def test_ch14_scheduler_io(ipc_dir: Path) -> None:
    out = run_example("ch14_scheduler_io.py", ipc_dir, 170)
    assert "rank 0 received uids: [0, 1, 2]" in out
    assert "rank 1 received uids: [0, 1, 2]" in out
    assert not any(ipc_dir.iterdir())  # the example removed its socket directory

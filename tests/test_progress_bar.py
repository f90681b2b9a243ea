"""`minisgl.utils.progress_bar`: a bar drawn in a spawned child that leaves with os._exit (as the
server's children do) leaves no semaphore for multiprocessing's resource tracker to warn about;
tqdm's own multiprocessing lock does (the control, so the check can fail)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import multiprocessing as mp, os, sys

def child(ours: bool) -> None:
    if ours:
        from minisgl.utils.progress_bar import progress_bar as bar
    else:
        from tqdm.auto import tqdm as bar
    for _ in bar(range(3), desc="Loading weights"):
        pass
    os._exit(0)

if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=child, args=(sys.argv[1] == "ours",))
    p.start()
    p.join()
    sys.exit(p.exitcode)
"""


@pytest.mark.parametrize("bar", ["ours", "tqdm"])
def test_a_bar_in_a_child_leaves_no_semaphore(bar: str, tmp_path) -> None:  # noqa: ANN001
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = subprocess.run([sys.executable, str(script), bar], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Loading weights" in out.stderr  # the bar was drawn
    leaked = "leaked semaphore" in out.stderr
    assert leaked == (bar == "tqdm"), out.stderr

"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU, minisgl's Triton kernels run in Triton's CPU interpreter (small shapes, slowly), so
# the suite checks their logic everywhere. Set before any test module imports a kernel: the choice
# is made when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# What the fuzz tests sent (name -> count), printed at the end of the run for the note.
FUZZ_COUNTS: dict[str, int] = {}


@pytest.fixture
def fuzz_report():
    """`fuzz_report(name, count)` records how many inputs a fuzz test sent."""

    def record(name: str, count: int) -> None:
        FUZZ_COUNTS[name] = FUZZ_COUNTS.get(name, 0) + count

    return record


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FUZZ_COUNTS:
        terminalreporter.section("fuzz counts")
        for name, count in FUZZ_COUNTS.items():
            terminalreporter.write_line(f"{count:>8,}  {name}")


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A short directory under /tmp for ipc:// socket paths (sun_path holds only 104-108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="msgl-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

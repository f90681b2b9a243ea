"""Anonymous memory in 2 MiB pages (`huge_page_buffer`): aligned, zeroed, writable, advised."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from minisgl.utils.pages import HUGE_PAGE, huge_page_buffer


def smaps_field(address: int, name: str) -> list[str]:
    """The words after `name` (e.g. "Rss:", "VmFlags:") of this process's mapping that holds
    `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == name:
            return line.split()[1:]
    raise AssertionError("no mapping holds the address")


def test_huge_page_buffer_is_aligned_zeroed_and_writable() -> None:
    buf = huge_page_buffer(HUGE_PAGE + 5)
    assert buf.dtype == torch.uint8 and buf.numel() == 2 * HUGE_PAGE  # whole pages
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert int(buf.count_nonzero()) == 0
    buf[-1] = 7
    assert int(buf[-1]) == 7


@pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or not hasattr(mmap, "MADV_HUGEPAGE")
    or not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
    reason="a Linux kernel with transparent huge pages",
)
def test_huge_page_buffer_is_private_memory_advised_hugepage() -> None:
    """Private (shared anonymous memory would be shmem, under another huge-page switch) and marked
    `hg` (VM_HUGEPAGE) by the kernel, which then backs it with 2 MiB pages where THP is enabled."""
    buf = huge_page_buffer(1)
    flags = set(smaps_field(buf.data_ptr(), "VmFlags:"))
    assert "hg" in flags and "sh" not in flags, flags

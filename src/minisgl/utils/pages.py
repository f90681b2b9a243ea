"""Pages of memory: handing a read-only file mapping's pages back to the page cache
(`madvise(MADV_DONTNEED)`), and anonymous memory in 2 MiB pages for what every step streams."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import torch

_MADV_DONTNEED = 4
_libc: ctypes.CDLL | None = None


def release_pages(view: torch.Tensor) -> int:
    """Drop the whole pages that `view` (a 2-D uint8 view of a read-only shared file mapping, rows
    possibly strided) spans from this process's memory; a later read faults them in again from the
    file. Never call it on anonymous memory: there it would zero the pages. Returns the bytes dropped."""
    global _libc
    if view.numel() == 0:
        return 0
    start = view.data_ptr()
    end = start + (view.shape[0] - 1) * view.stride(0) + view.shape[1]
    page = mmap.PAGESIZE
    first, last = (start + page - 1) // page * page, end // page * page
    if last <= first:
        return 0
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if _libc.madvise(first, last - first, _MADV_DONTNEED) != 0:
        return 0
    return last - first


HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages): a transparent huge page


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` (rounded up to whole 2 MiB pages) of zeroed anonymous memory as a uint8 tensor that
    starts on a 2 MiB boundary, advised `MADV_HUGEPAGE`: where transparent huge pages are enabled
    ("always" or "madvise") the kernel backs it with 2 MiB pages as it is first written, so reading it
    end to end takes one TLB entry per 2 MiB instead of one per 4 KiB. Elsewhere (THP "never", no
    madvise) it is plain memory. The tensor keeps its mapping alive."""
    size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
    # private: shared anonymous memory is shmem, whose huge pages follow another switch (shmem_enabled)
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=flags)  # room to start on a 2 MiB boundary
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, size)
        except OSError:  # e.g. a kernel built without transparent huge pages
            pass
    return whole[start : start + size]

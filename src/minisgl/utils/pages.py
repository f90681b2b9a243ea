"""Handing a read-only file mapping's pages back to the page cache (`madvise(MADV_DONTNEED)`)."""

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

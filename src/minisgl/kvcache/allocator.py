"""The page allocator: which KV pages are free.

Deterministic on purpose: every tensor-parallel rank runs the same scheduler, so the same calls must
return the same pages on every rank (a sorted free list, lowest page first; no sets, no time).
"""

from __future__ import annotations

import numpy as np


class OutOfPagesError(RuntimeError):
    """Asked for more pages than are free (the scheduler checks `num_free` first)."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        # A stack: the lowest page ids are handed out first; freed pages are reused first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} KV pages, only {len(self._free)} free")
        if n <= 0:
            return []
        pages = self._free[-n:][::-1]
        del self._free[-n:]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} is not in the pool (0..{self.num_pages - 1})")
            if self._is_free[p]:
                raise ValueError(f"page {p} freed twice")
            self._is_free[p] = 1
        self._free.extend(reversed(pages))

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def free_mask(self) -> np.ndarray:
        """(num_pages,) bool, True where the page is free (a copy)."""
        return np.frombuffer(self._is_free, dtype=np.uint8).astype(bool)

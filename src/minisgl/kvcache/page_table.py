"""Per-request page tables: which pages hold a request's tokens, in order.

Token `i` of the request in row `r` lives at slot `pages[r, i // page_size] * page_size + i % page_size`
of the KV pool. The table is a CPU int32 tensor so the engine can turn a batch's rows into KV slots in
one vectorised gather; Python lists mirror it for the bookkeeping (growth, freeing, integrity checks).

A row's first `row_shared[row]` pages belong to the prefix cache (a cached prefix the request
borrows, or its own prefix once cached); the rest are the request's own. Freeing a row frees only
its own pages.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from .allocator import PageAllocator

logger = logging.getLogger(__name__)


class KVIntegrityError(RuntimeError):
    """A page is leaked (owned by nobody and not free) or owned twice, or the prefix cache's
    bookkeeping disagrees with the requests that use it."""


class PageTable:
    def __init__(self, allocator: PageAllocator, page_size: int, max_rows: int, max_seq_len: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.max_pages_per_row = -(-max_seq_len // page_size)
        self.table = torch.zeros(max_rows, self.max_pages_per_row, dtype=torch.int32)  # (R, P)
        self.row_pages: list[list[int]] = [[] for _ in range(max_rows)]
        self.row_shared: list[int] = [0] * max_rows  # leading pages held by the prefix cache
        self.row_owner: list[int | None] = [None] * max_rows  # uid per row, None = free row
        self._free_rows: list[int] = list(range(max_rows - 1, -1, -1))

    # -- rows ---------------------------------------------------------------------------------------
    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self, uid: int, shared_pages: Sequence[int] = ()) -> int:
        """A row for request `uid`, starting with `shared_pages` (a cached prefix it borrows)."""
        row = self._free_rows.pop()
        self.row_owner[row] = uid
        self.row_pages[row] = list(shared_pages)
        self.row_shared[row] = len(shared_pages)
        if shared_pages:
            self.table[row, : len(shared_pages)] = torch.tensor(shared_pages, dtype=torch.int32)
        return row

    def free_row(self, row: int) -> None:
        """Give back the row and the pages it owns (the shared ones stay with the prefix cache)."""
        self.allocator.free(self.row_pages[row][self.row_shared[row] :])
        self.row_pages[row] = []
        self.row_shared[row] = 0
        self.row_owner[row] = None
        self._free_rows.append(row)

    def share_prefix(self, row: int, cache_pages: Sequence[int]) -> None:
        """The prefix cache now holds the row's first `len(cache_pages)` pages' tokens, in
        `cache_pages`. Where the row had its own copy of a page the cache already held, the row
        switches to the cache's page and its copy is freed (the same tokens' K/V: a step still in
        flight may read the copy, and device work runs in order, so a later owner writes after)."""
        pages, start = self.row_pages[row], self.row_shared[row]
        if pages[:start] != list(cache_pages[:start]) or len(cache_pages) > len(pages):
            raise KVIntegrityError(f"row {row}: the prefix cache's pages do not continue its shared prefix")
        copies = [p for p, c in zip(pages[start:], cache_pages[start:], strict=False) if p != c]
        pages[start : len(cache_pages)] = cache_pages[start:]
        if copies:
            self.table[row, start : len(cache_pages)] = torch.tensor(cache_pages[start:], dtype=torch.int32)
            self.allocator.free(copies)
        self.row_shared[row] = max(start, len(cache_pages))

    # -- pages --------------------------------------------------------------------------------------
    def pages_needed(self, row: int, num_tokens: int) -> int:
        """Extra pages row `row` needs to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.page_size) - len(self.row_pages[row]))

    def reserve(self, row: int, num_tokens: int) -> bool:
        """Grow row `row` to hold `num_tokens` tokens; False (and nothing taken) if pages are short."""
        need = self.pages_needed(row, num_tokens)
        if need == 0:
            return True
        if need > self.allocator.num_free:
            return False
        if len(self.row_pages[row]) + need > self.max_pages_per_row:
            raise ValueError(f"{num_tokens} tokens exceed the page table's {self.max_pages_per_row} pages")
        pages = self.allocator.alloc(need)
        start = len(self.row_pages[row])
        self.row_pages[row].extend(pages)
        self.table[row, start : start + need] = torch.tensor(pages, dtype=torch.int32)
        return True

    # -- checks -------------------------------------------------------------------------------------
    def check_integrity(self, live_uids: set[int] | None = None, cached_pages: Sequence[int] = ()) -> None:
        """Every page is exactly one of: free, owned by one row, held by the prefix cache
        (`cached_pages`); a row's shared pages are cached ones; rows belong to live requests.

        Raises KVIntegrityError naming what is wrong (a leak is a bug: it would shrink the pool forever).
        """
        n = self.allocator.num_pages
        cached = _counts(cached_pages, n)
        problems = []
        owned: list[int] = []
        for row, pages in enumerate(self.row_pages):
            if pages and self.row_owner[row] is None:
                raise KVIntegrityError(f"free page-table row {row} still holds pages {pages[:8]}")
            shared = self.row_shared[row]
            problems += [f"row {row} shares page {p}, which the prefix cache does not hold"
                         for p in pages[:shared] if not cached[p]]  # fmt: skip
            owned += pages[shared:]
        # Per page in numpy: a GPU pool has hundreds of thousands of pages, checked at every idle moment
        owners = _counts(owned, n)
        holders = owners + cached
        free = self.allocator.free_mask()
        for p in np.flatnonzero((free & (holders > 0)) | (~free & (holders != 1))).tolist():
            state = "free" if free[p] else "allocated"
            problems.append(
                f"page {p} is {state} but owned by {int(owners[p])} request(s) and {int(cached[p])} cache node(s)"
            )
        if live_uids is not None:
            for row, uid in enumerate(self.row_owner):
                if uid is not None and uid not in live_uids:
                    problems.append(f"row {row} belongs to uid {uid}, which is no longer live")
        if problems:
            msg = f"KV cache integrity check failed ({len(problems)} problems): " + "; ".join(problems[:8])
            logger.error(msg)
            raise KVIntegrityError(msg)


def _counts(pages: Sequence[int], n: int) -> np.ndarray:
    """How many times each of the pages 0..n-1 appears in `pages`, (n,) int64."""
    return np.bincount(np.fromiter(pages, dtype=np.int64, count=len(pages)), minlength=n)[:n]

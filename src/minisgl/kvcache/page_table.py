"""Per-request page tables: which pages hold a request's tokens, in order.

Token `i` of the request in row `r` lives at slot `pages[r, i // page_size] * page_size + i % page_size`
of the KV pool. The table is a CPU int32 tensor so the engine can turn a batch's rows into KV slots in
one vectorised gather; Python lists mirror it for the bookkeeping (growth, freeing, integrity checks).
"""

from __future__ import annotations

import logging

import torch

from .allocator import PageAllocator

logger = logging.getLogger(__name__)


class KVIntegrityError(RuntimeError):
    """A page is leaked (owned by nobody and not free) or owned twice."""


class PageTable:
    def __init__(self, allocator: PageAllocator, page_size: int, max_rows: int, max_seq_len: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.max_pages_per_row = -(-max_seq_len // page_size)
        self.table = torch.zeros(max_rows, self.max_pages_per_row, dtype=torch.int32)  # (R, P)
        self.row_pages: list[list[int]] = [[] for _ in range(max_rows)]
        self.row_owner: list[int | None] = [None] * max_rows  # uid per row, None = free row
        self._free_rows: list[int] = list(range(max_rows - 1, -1, -1))

    # -- rows ---------------------------------------------------------------------------------------
    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self, uid: int) -> int:
        row = self._free_rows.pop()
        self.row_owner[row] = uid
        return row

    def free_row(self, row: int) -> None:
        """Give back the row and every page it holds."""
        self.allocator.free(self.row_pages[row])
        self.row_pages[row] = []
        self.row_owner[row] = None
        self._free_rows.append(row)

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
    def check_integrity(self, live_uids: set[int] | None = None) -> None:
        """Every page is free or owned by exactly one row; rows belong to live requests.

        Raises KVIntegrityError naming what is wrong (a leak is a bug: it would shrink the pool forever).
        """
        n = self.allocator.num_pages
        owners = [0] * n
        for row, pages in enumerate(self.row_pages):
            if pages and self.row_owner[row] is None:
                raise KVIntegrityError(f"free page-table row {row} still holds pages {pages[:8]}")
            for p in pages:
                owners[p] += 1
        problems = []
        for p in range(n):
            free = self.allocator.is_free(p)
            if free and owners[p]:
                problems.append(f"page {p} is free but owned by {owners[p]} request(s)")
            elif not free and owners[p] != 1:
                problems.append(f"page {p} is allocated but owned by {owners[p]} request(s)")
        if live_uids is not None:
            for row, uid in enumerate(self.row_owner):
                if uid is not None and uid not in live_uids:
                    problems.append(f"row {row} belongs to uid {uid}, which is no longer live")
        if problems:
            msg = f"KV cache integrity check failed ({len(problems)} problems): " + "; ".join(problems[:8])
            logger.error(msg)
            raise KVIntegrityError(msg)

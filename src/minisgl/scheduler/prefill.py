"""Prefill: the waiting queue, admission into the KV pool, and chunking under a token budget."""

from __future__ import annotations

from collections import deque

from minisgl.core import Batch, Req, ReqStatus

from .cache import CacheManager


class PrefillManager:
    """Requests not yet decoding: `waiting` (no pages yet, FIFO: WAITING, or RETRACTED at the front)
    and `prefilling` (PREFILLING: pages held for all their tokens, some chunks still to run, in
    admission order).

    Admission borrows the longest cached prefix of a request's tokens and takes pages for the rest
    of its prompt at once, so a started prefill never stalls for pages and feeds only the uncached
    suffix; the head of the queue waits (FIFO, no overtaking) until enough pages are available, and
    while a request being prefilled is about to cache more of its prefix (it then borrows that
    instead of computing it again).
    """

    def __init__(self, cache: CacheManager, max_prefill_tokens: int) -> None:
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.cache = cache
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []
        self.num_page_waits = 0  # steps in which the queue's head waited for KV pages
        self.num_prefix_waits = 0  # steps in which it waited for a prefix another request computes
        self._last_batch: Batch | None = None  # the last prefill batch (with overlap, maybe in flight)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.prefilling)

    def add(self, req: Req, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(req)

    def remove(self, uid: int) -> Req | None:
        """Take request `uid` out (waiting or prefilling); the caller frees its pages."""
        for i, r in enumerate(self.prefilling):
            if r.uid == uid:
                return self.prefilling.pop(i)
        for r in self.waiting:
            if r.uid == uid:
                self.waiting.remove(r)
                return r
        return None

    def schedule(self, reserve_pages: int, admit: bool) -> Batch | None:
        """The next prefill batch: unfinished chunks first, then new admissions, within the budget.

        reserve_pages: pages to leave free for running requests to grow into.
        admit: False while the pool is under pressure (see Scheduler) — only started prefills continue.
        """
        budget = self.max_prefill_tokens
        reqs: list[Req] = []
        lens: list[int] = []
        for r in self.prefilling:
            if budget == 0:
                break
            n = min(r.remaining_len, budget)
            reqs.append(r)
            lens.append(n)
            budget -= n
        if not admit and self.waiting:
            self.num_page_waits += 1
        while budget > 0 and admit and self.waiting and self._admit(self.waiting[0], reserve_pages):
            r = self.waiting.popleft()
            r.move_to(ReqStatus.PREFILLING)
            self.prefilling.append(r)
            n = min(r.remaining_len, budget)
            reqs.append(r)
            lens.append(n)
            budget -= n
        if not reqs:
            return None
        self._last_batch = Batch(reqs, lens, "prefill")
        return self._last_batch

    def _admit(self, req: Req, reserve_pages: int) -> bool:
        if self.cache.table.num_free_rows == 0:
            return False
        if self.cache.waits_for_prefix(req, self._producers()):
            self.num_prefix_waits += 1
            return False
        if not self.cache.admit(req, reserve_pages):
            self.num_page_waits += 1
            return False
        return True

    def _producers(self) -> list[Req]:
        """Requests whose prompt K/V will enter the prefix cache soon: those being prefilled, and
        those whose last chunk is still in flight (overlap scheduling)."""
        last = self._last_batch
        if last is None:
            return self.prefilling
        in_flight = [  # its result not taken yet
            r
            for r, end in zip(last.reqs, last.kv_ends, strict=True)
            if r.kv_ready_len < end and r.holds_pages and r not in self.prefilling
        ]
        return self.prefilling + in_flight

    def done(self, req: Req) -> None:
        """`req` ran its last chunk (it decodes from now on)."""
        self.prefilling.remove(req)

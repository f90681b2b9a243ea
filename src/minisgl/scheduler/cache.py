"""The scheduler's KV pages: each request's page-table row, the prefix cache and the allocator, kept
consistent with each other.

A request's row is [pages the prefix cache holds | the request's own pages]. Admission borrows the
longest cached prefix (locking its node) and allocates the rest; as steps return, the whole pages
whose K/V they computed move into the cache (the row then borrows them too), so later requests with
the same prefix share them even while this one runs; release (finish, abort, retraction) caches what
was computed, unlocks, and frees the request's own pages. When the allocator runs short, unlocked
cached pages are evicted (least recently used first) before anyone waits or is retracted.

Only K/V that a returned step computed enter the cache (`Req.kv_ready_len`): with overlap scheduling a
step still in flight may be writing a request's newest positions, and those never reach the tree.
Pages freed or evicted on the host while a step in flight still reads them are safe: device work runs
in order, so the next owner's writes come after that step.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.core import Req
from minisgl.kvcache import KVIntegrityError, PageTable, PrefixCache, RadixNode, path_pages


@dataclass
class CacheStats:
    """Counted at each request's first admission (a retracted request is not counted again)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    evicted_pages: int = 0


class CacheManager:
    def __init__(self, table: PageTable, cache: PrefixCache) -> None:
        self.table = table
        self.prefix = cache
        self.page_size = table.page_size
        self.stats = CacheStats()
        self._locks: dict[int, RadixNode] = {}  # uid -> the node its row's shared pages end at

    @property
    def num_available(self) -> int:
        """Pages a request could get now: free ones plus cached ones nobody pins."""
        return self.table.allocator.num_free + self.prefix.num_evictable

    # -- requests -------------------------------------------------------------------------------------
    def admit(self, req: Req, reserve_pages: int) -> bool:
        """Give `req` a row: the longest cached prefix of its tokens, never the last one (a step must
        compute at least one token's logits), and its own pages for the rest. False, and nothing
        taken, unless the available pages cover that plus `reserve_pages` of headroom."""
        # A request that wants its prompt's logprobs (or an embedding) needs every prompt position.
        match = self.prefix.match(req.token_ids[: 0 if req.computes_whole_prompt else req.seq_len - 1])
        need = -(-req.seq_len // self.page_size) - len(match.pages)
        self.prefix.lock(match.node)
        if need + reserve_pages > self.num_available or not self.make_room(need):
            self.prefix.unlock(match.node)
            return False
        row = self.table.alloc_row(req.uid, match.pages)
        ok = self.table.reserve(row, req.seq_len)
        assert ok, "room was made just above"
        self._locks[req.uid] = match.node
        req.table_row = row
        req.cached_len = req.kv_ready_len = match.num_tokens
        if req.cached_prompt_len < 0:
            req.cached_prompt_len = min(match.num_tokens, req.prompt_len)
            self.stats.prompt_tokens += req.prompt_len
            self.stats.cached_tokens += req.cached_prompt_len
        return True

    def waits_for_prefix(self, req: Req, producers: list[Req]) -> bool:
        """Whether `req` should wait because a request being prefilled (`producers`) will soon cache
        at least one more whole page of `req`'s prefix than is cached now: admitted now, `req` would
        compute those tokens a second time (concurrent requests with one system prompt)."""
        if req.computes_whole_prompt:  # it will not borrow a prefix anyway
            return False
        limit = req.token_ids[: req.seq_len - 1]
        cached = len(self.prefix.match(limit).pages)
        return any(_common_pages(p.token_ids, limit, self.page_size) > cached for p in producers)

    def grow(self, req: Req, num_tokens: int) -> bool:
        """Room for `num_tokens` tokens in `req`'s row (evicting if needed); False if pages are short."""
        return self.make_room(self.table.pages_needed(req.table_row, num_tokens)) and self.table.reserve(
            req.table_row, num_tokens
        )

    def cache_prefix(self, req: Req) -> None:
        """Move the whole pages of `req`'s first `kv_ready_len` tokens into the prefix cache; where the
        cache already held them (another request got there first) the row switches to its pages.
        An embedding request's K/V are not kept: its pages are freed when it is done."""
        if req.sampling_params.embed:
            return
        row = req.table_row
        n = min(req.kv_ready_len, req.seq_len) // self.page_size
        if n <= self.table.row_shared[row]:
            return
        match = self.prefix.insert(req.token_ids[: n * self.page_size], self.table.row_pages[row][:n])
        self.table.share_prefix(row, match.pages)
        self.prefix.lock(match.node)
        self.prefix.unlock(self._locks[req.uid])
        self._locks[req.uid] = match.node

    def release(self, req: Req) -> bool:
        """`req` gives its row back (finished, aborted or retracted): its computed whole pages stay
        cached, unpinned; its other pages are freed. True if it held a row."""
        if req.table_row < 0:
            return False
        self.cache_prefix(req)
        self.prefix.unlock(self._locks.pop(req.uid))
        self.table.free_row(req.table_row)
        req.table_row = -1
        return True

    def make_room(self, num_pages: int) -> bool:
        """At least `num_pages` free pages, evicting unpinned cached pages if needed; False (nothing
        evicted) if even eviction cannot free that many."""
        alloc = self.table.allocator
        short = num_pages - alloc.num_free
        if short <= 0:
            return True
        if short > self.prefix.num_evictable:
            return False
        evicted = self.prefix.evict(short)
        alloc.free(evicted)
        self.stats.evicted_pages += len(evicted)
        return True

    def flush(self) -> int:
        """Evict every cached page no request pins (a benchmark round starts cold); how many."""
        evicted = self.prefix.evict(self.prefix.num_evictable)
        self.table.allocator.free(evicted)
        self.stats.evicted_pages += len(evicted)
        return len(evicted)

    # -- checks ---------------------------------------------------------------------------------------
    def check_integrity(self, live: list[Req]) -> None:
        """Pages: each free, owned by one live request, or held by the cache; the cache's references
        are exactly the live requests' locks; each row's shared pages are its lock's path."""
        holders = sorted(r.uid for r in live if r.table_row >= 0)
        if holders != sorted(self._locks):
            raise KVIntegrityError(f"prefix-cache locks held by {sorted(self._locks)}, rows by {holders}")
        self.prefix.check([self._locks[uid] for uid in holders])
        self.table.check_integrity({r.uid for r in live}, self.prefix.held_pages())
        for r in live:
            if r.table_row >= 0:
                shared = self.table.row_pages[r.table_row][: self.table.row_shared[r.table_row]]
                if shared != path_pages(self._locks[r.uid]):
                    raise KVIntegrityError(f"request {r.uid}: its shared pages are not its cache path")


def _common_pages(a: list[int], b: list[int], ps: int) -> int:
    """Whole pages that `a` and `b` share from their start."""
    n = min(len(a), len(b)) // ps
    if a[: n * ps] == b[: n * ps]:
        return n
    i = 0
    while a[i * ps : (i + 1) * ps] == b[i * ps : (i + 1) * ps]:
        i += 1
    return i

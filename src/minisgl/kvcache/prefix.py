"""The prefix caches behind one interface: `radix` (shares cached prefixes, the default) and `naive`
(caches nothing: every request prefills its whole prompt, as before the radix cache existed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from . import CACHE_TYPES
from .radix import PrefixMatch, RadixCache, RadixNode


class PrefixCache(Protocol):
    """What the scheduler's cache manager calls (see `RadixCache` for the semantics)."""

    page_size: int
    num_pages: int  # pages the cache holds
    num_evictable: int  # of which no live request pins

    def match(self, token_ids: list[int]) -> PrefixMatch: ...
    def insert(self, token_ids: list[int], pages: list[int]) -> PrefixMatch: ...
    def lock(self, node: RadixNode) -> None: ...
    def unlock(self, node: RadixNode) -> None: ...
    def evict(self, num_pages: int) -> list[int]: ...
    def held_pages(self) -> list[int]: ...
    def check(self, locked: Sequence[RadixNode] = ()) -> None: ...


class NaiveCache:
    """Caches nothing: every match is empty, inserting keeps no page, nothing is ever evictable."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.num_pages = 0
        self.num_evictable = 0
        self.root = RadixNode(node_id=0, key=[], pages=[], parent=None)

    def match(self, token_ids: list[int]) -> PrefixMatch:
        return PrefixMatch(self.root, [], self.page_size)

    def insert(self, token_ids: list[int], pages: list[int]) -> PrefixMatch:
        return PrefixMatch(self.root, [], self.page_size)

    def lock(self, node: RadixNode) -> None:
        pass

    def unlock(self, node: RadixNode) -> None:
        pass

    def evict(self, num_pages: int) -> list[int]:
        return []

    def held_pages(self) -> list[int]:
        return []

    def check(self, locked: Sequence[RadixNode] = ()) -> None:
        pass


def create_prefix_cache(kind: str, page_size: int) -> PrefixCache:
    if kind == "radix":
        return RadixCache(page_size)
    if kind == "naive":
        return NaiveCache(page_size)
    raise ValueError(f"unknown cache type {kind!r} (choose from {', '.join(CACHE_TYPES)})")

"""The radix prefix cache: K/V pages of token-id prefixes that requests share (RadixAttention).

Chat turns, shared system prompts and few-shot prompts resend long prefixes. The tree maps token-id
prefixes to the KV pages that hold their K/V, so a new request whose prompt starts with a cached
prefix borrows those pages and prefills only the rest. Page-granular: only whole pages are cached
and shared (a partial last page stays private to its request), so a page is never written by two
requests.

A request *locks* the deepest node it uses; that pins the node and every ancestor. Pages of
unreferenced nodes stay cached until the pool runs short, then the least recently used leaves give
their pages back (tail pages first). "Recently" is a logical clock, never wall time, and ties go to
the node id: every tensor-parallel rank, making the same calls, evicts the same pages.

┌─ Invariants (`check` verifies each) ───────────────────────────────────────────────────────────┐
│ 1. Every node but the root holds k >= 1 whole pages: len(key) == k * page_size == len(pages) *   │
│    page_size; the root holds nothing.                                                           │
│ 2. A node's key continues its parent's: the keys on the path from the root spell the token ids  │
│    whose K/V the path's pages hold, in order. Children are keyed by their first page's token    │
│    ids, so siblings differ in their first page and a prefix has at most one path.              │
│ 3. A page is held by at most one node (and is then neither free nor any request's own page).    │
│ 4. ref(node) == locks on node + sum(ref(child)): a lock pins its node's whole path. Only nodes  │
│    with ref 0 are evictable, and only as leaves (children go first), so a locked path is never  │
│    evicted.                                                                                     │
│ 5. num_pages == pages over all nodes; num_evictable == pages over nodes with ref 0.             │
│ 6. No wall clock and no set or dict iteration decides anything: LRU order is (last_use, id).    │
└────────────────────────────────────────────────────────────────────────────────────────────────┘
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from .page_table import KVIntegrityError

PageKey = tuple[int, ...]  # the token ids of one page: a child's key in its parent


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree: `key` (token ids, whole pages) and the `pages` holding their K/V."""

    node_id: int
    key: list[int]
    pages: list[int]
    parent: RadixNode | None
    children: dict[PageKey, RadixNode] = field(default_factory=dict)
    ref: int = 0  # requests whose locked node is this one or below it
    last_use: int = 0  # the logical clock at the last match or insert that went through it

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of some token ids: its deepest node (lock it before using the
    pages) and its pages, in order. `node` is the root when nothing matched."""

    node: RadixNode
    pages: list[int]
    page_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.pages) * self.page_size


class RadixCache:
    """The tree. The caller (the scheduler's cache manager) moves pages in and out of the allocator:
    `insert` takes over pages a request computed, `evict` hands pages back for freeing."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.root = RadixNode(node_id=0, key=[], pages=[], parent=None)
        self.num_pages = 0
        self.num_evictable = 0
        self._num_nodes = 1
        self._next_id = 1
        self._clock = 0
        # Evictable leaves by (last_use, id, push order): stale entries (a node touched, locked,
        # given children or removed since) are skipped when popped, and purged when they pile up.
        self._heap: list[tuple[int, int, int, RadixNode]] = []
        self._pushes = 0

    # -- lookups ----------------------------------------------------------------------------------
    def match(self, token_ids: list[int]) -> PrefixMatch:
        """The longest cached prefix of `token_ids` in whole pages (a node that matches only partly
        is split, so the match ends on a node). Marks the path as used now."""
        node, pages = self._walk(token_ids)
        return PrefixMatch(node, pages, self.page_size)

    def insert(self, token_ids: list[int], pages: list[int]) -> PrefixMatch:
        """Cache the whole pages of `token_ids`, whose K/V are in `pages` (one per page, computed).

        The part already cached keeps the tree's pages: the returned match lists the tree's pages for
        the whole inserted prefix, and where they differ from `pages` the caller's copies are
        duplicates it should free. The part not yet cached takes over the caller's pages."""
        ps = self.page_size
        n = len(token_ids) // ps
        if len(pages) < n:
            raise ValueError(f"{n} pages of tokens but only {len(pages)} pages given")
        node, path = self._walk(token_ids[: n * ps])
        if len(path) < n:
            leaf = self._new_node(list(token_ids[len(path) * ps : n * ps]), list(pages[len(path) : n]), node)
            self.num_pages += len(leaf.pages)
            self.num_evictable += len(leaf.pages)
            self._push(leaf)
            path = path + leaf.pages
            node = leaf
        return PrefixMatch(node, path, ps)

    # -- references -------------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        """Pin `node` and its ancestors (a request uses their pages)."""
        while node.parent is not None:
            if node.ref == 0:
                self.num_evictable -= len(node.pages)
            node.ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`; the path becomes evictable where nothing else pins it."""
        if node.parent is None and node is not self.root:
            raise KVIntegrityError(f"radix node {node.node_id} is unlocked but no longer in the tree")
        first = node
        while node.parent is not None:
            if node.ref <= 0:
                raise KVIntegrityError(f"radix node {node.node_id} unlocked more often than locked")
            node.ref -= 1
            if node.ref == 0:
                self.num_evictable += len(node.pages)
            node = node.parent
        self._push(first)

    # -- eviction ---------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> list[int]:
        """Take up to `num_pages` pages out of the tree, least recently used leaves first (the tail
        pages of a leaf first), and return them; the caller frees them."""
        out: list[int] = []
        while len(out) < num_pages and self._heap:
            last_use, _, _, node = heapq.heappop(self._heap)
            if not self._evictable_leaf(node) or node.last_use != last_use:
                continue  # a stale entry
            take = min(len(node.pages), num_pages - len(out))
            out.extend(reversed(node.pages[len(node.pages) - take :]))
            self.num_pages -= take
            self.num_evictable -= take
            if take < len(node.pages):
                del node.pages[len(node.pages) - take :]
                del node.key[len(node.pages) * self.page_size :]
                self._push(node)
            else:
                self._remove(node)
        return out

    # -- inspection -------------------------------------------------------------------------------
    def nodes(self) -> list[RadixNode]:
        """Every node but the root, parents before children (depth first, in insertion order)."""
        out: list[RadixNode] = []
        stack = list(reversed(self.root.children.values()))
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children.values()))
        return out

    def held_pages(self) -> list[int]:
        return [p for node in self.nodes() for p in node.pages]

    def check(self, locked: Sequence[RadixNode] = ()) -> None:
        """Verify the invariants above; `locked`: one entry per lock held (by the live requests).
        Raises KVIntegrityError naming the first problem."""
        locks: dict[int, int] = {}
        for node in locked:
            if not self._attached(node):
                raise KVIntegrityError(f"a request holds radix node {node.node_id}, which is not in the tree")
            locks[node.node_id] = locks.get(node.node_id, 0) + 1
        seen: set[int] = set()
        pages = evictable = 0
        for node in reversed(self.nodes()):  # children before parents
            self._check_node(node, locks, seen)
            pages += len(node.pages)
            evictable += len(node.pages) if node.ref == 0 else 0
        if (pages, evictable) != (self.num_pages, self.num_evictable):
            raise KVIntegrityError(
                f"radix cache counts {self.num_pages} pages ({self.num_evictable} evictable), "
                f"its nodes hold {pages} ({evictable})"
            )

    # -- internals --------------------------------------------------------------------------------
    def _walk(self, token_ids: list[int]) -> tuple[RadixNode, list[int]]:
        """Follow `token_ids` down whole pages; split the last node if the match ends inside it."""
        ps = self.page_size
        self._clock += 1
        node, pages, pos = self.root, [], 0
        limit = len(token_ids) // ps * ps
        while pos < limit:
            child = node.children.get(tuple(token_ids[pos : pos + ps]))
            if child is None:
                break
            n = _matching_pages(child.key, token_ids, pos, limit, ps)
            partly = n < len(child.pages)
            if partly:  # the unmatched rest keeps its place in the LRU order
                child = self._split(child, n)
            child.last_use = self._clock
            self._push(child)  # if an evictable leaf, its place in the LRU order moved
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
            if partly:
                break
        return node, pages

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut `node` after its first `n` pages; the new upper node takes its place and is returned."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < n < len(node.pages)
        upper = self._new_node(node.key[: n * ps], node.pages[:n], parent)
        upper.ref, upper.last_use = node.ref, node.last_use
        node.key, node.pages = node.key[n * ps :], node.pages[n:]
        node.parent = upper
        upper.children[tuple(node.key[:ps])] = node
        return upper

    def _new_node(self, key: list[int], pages: list[int], parent: RadixNode) -> RadixNode:
        node = RadixNode(node_id=self._next_id, key=key, pages=pages, parent=parent, last_use=self._clock)
        self._next_id += 1
        self._num_nodes += 1
        parent.children[tuple(key[: self.page_size])] = node  # replaces the child it splits
        return node

    def _remove(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[tuple(node.key[: self.page_size])]
        node.parent = None
        self._num_nodes -= 1
        if parent.parent is not None:
            self._push(parent)  # it may have become an evictable leaf

    def _evictable_leaf(self, node: RadixNode) -> bool:
        return node.parent is not None and node.ref == 0 and node.is_leaf

    def _push(self, node: RadixNode) -> None:
        if not self._evictable_leaf(node):
            return
        if len(self._heap) > 2 * self._num_nodes + 64:  # mostly stale: rebuild
            self._heap = [e for e in self._heap if self._evictable_leaf(e[3]) and e[0] == e[3].last_use]
            heapq.heapify(self._heap)
        self._pushes += 1
        heapq.heappush(self._heap, (node.last_use, node.node_id, self._pushes, node))

    def _attached(self, node: RadixNode) -> bool:
        while node.parent is not None:
            if node.parent.children.get(tuple(node.key[: self.page_size])) is not node:
                return False
            node = node.parent
        return node is self.root

    def _check_node(self, node: RadixNode, locks: dict[int, int], seen: set[int]) -> None:
        ps = self.page_size
        where = f"radix node {node.node_id}"
        if not node.pages or len(node.key) != len(node.pages) * ps:
            raise KVIntegrityError(f"{where}: {len(node.key)} tokens for {len(node.pages)} pages of {ps}")
        for p in node.pages:
            if p in seen:
                raise KVIntegrityError(f"{where}: page {p} is held by two nodes")
            seen.add(p)
        expect = locks.get(node.node_id, 0) + sum(c.ref for c in node.children.values())
        if node.ref != expect:
            raise KVIntegrityError(
                f"{where}: ref {node.ref}, but its locks and children's refs sum to {expect}"
            )
        for k, child in node.children.items():
            if child.parent is not node or tuple(child.key[:ps]) != k:
                raise KVIntegrityError(
                    f"{where}: child {child.node_id} is filed under the wrong key or parent"
                )


def _matching_pages(key: list[int], token_ids: list[int], pos: int, limit: int, ps: int) -> int:
    """How many whole pages of `key` equal `token_ids[pos:limit]` page by page (the first page is
    known to match)."""
    n = min(len(key), limit - pos) // ps
    if token_ids[pos : pos + n * ps] == key[: n * ps]:
        return n
    i = 1
    while i < n and token_ids[pos + i * ps : pos + (i + 1) * ps] == key[i * ps : (i + 1) * ps]:
        i += 1
    return i


def path_pages(node: RadixNode) -> list[int]:
    """The pages from the root down to `node`, in token order."""
    parts: list[list[int]] = []
    while node.parent is not None:
        parts.append(node.pages)
        node = node.parent
    return [p for part in reversed(parts) for p in part]

"""The radix prefix cache on its own: page-granular matching and insertion, splits, reference counts
that pin a path, LRU eviction by the logical clock (tail pages first, leaves before parents), the
integrity check, and a model-based property test against a plain dict of cached page prefixes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.kvcache import KVIntegrityError, NaiveCache, RadixCache, create_prefix_cache, path_pages

PS = 4


def test_match_and_insert_are_page_granular() -> None:
    c = RadixCache(PS)
    ids = list(range(100, 110))  # 10 tokens: 2 whole pages
    m = c.insert(ids, [7, 8, 9])
    assert m.pages == [7, 8] and m.num_tokens == 8  # the partial third page is not cached
    assert c.num_pages == 2 and c.num_evictable == 2
    assert c.match(ids).pages == [7, 8]
    assert c.match(ids[:7]).pages == [7]  # 7 tokens: only one whole page can match
    assert c.match(ids[:3]).pages == []
    assert c.match([1, 2, 3, 4, 5]).node is c.root
    c.check()


def test_a_partial_match_splits_the_node_and_insert_keeps_the_trees_pages() -> None:
    c = RadixCache(PS)
    a = list(range(12))
    c.insert(a, [1, 2, 3])
    b = a[:4] + [50, 51, 52, 53, 54, 55, 56, 57]
    m = c.match(b)
    assert m.pages == [1]  # diverges in the second page
    assert [n.pages for n in c.nodes()] == [[1], [2, 3]]  # split after one page
    ins = c.insert(b, [10, 11, 12])  # its first page is cached already: the tree keeps page 1
    assert ins.pages == [1, 11, 12] and path_pages(ins.node) == [1, 11, 12]
    assert sorted(c.held_pages()) == [1, 2, 3, 11, 12] and c.num_pages == 5
    c.check()
    with pytest.raises(ValueError, match="pages"):
        c.insert(list(range(8)), [1])  # fewer pages than whole pages of tokens


def test_locks_pin_the_whole_path_and_unlock_releases_it() -> None:
    c = RadixCache(PS)
    a = list(range(12))
    node = c.insert(a, [1, 2, 3]).node
    leaf = c.insert(a[:8] + [90, 91, 92, 93], [1, 2, 4]).node  # splits [1,2,3] into [1,2] + [3]
    c.lock(leaf)
    assert c.num_evictable == 1  # only page 3 (the other branch) is unpinned
    assert c.evict(10) == [3] and c.num_pages == 3
    assert c.evict(10) == []  # the locked path [1, 2] + [4] stays
    c.check([leaf])
    with pytest.raises(KVIntegrityError, match="ref"):
        c.check()  # a lock that no request claims
    c.unlock(leaf)
    assert c.num_evictable == 3
    with pytest.raises(KVIntegrityError, match="unlocked more often"):
        c.unlock(leaf)
    assert sorted(c.evict(10)) == [1, 2, 4] and c.num_pages == 0
    c.check()
    with pytest.raises(KVIntegrityError, match="not in the tree"):
        c.check([node])  # an evicted node
    with pytest.raises(KVIntegrityError, match="no longer in the tree"):
        c.unlock(leaf)


def test_eviction_is_lru_by_the_logical_clock_tail_pages_first() -> None:
    c = RadixCache(PS)
    c.insert([1] * 4 + [2] * 4, [10, 11])  # A: oldest
    c.insert([3] * 8, [20, 21])  # B
    c.insert([5] * 8, [30, 31])  # C: newest
    c.match([1] * 4 + [2] * 4 + [9])  # A used again: now B is the least recently used
    assert c.evict(1) == [21]  # B's tail page first
    assert c.evict(2) == [20, 31]  # the rest of B, then C (older than A now), from its tail
    assert c.evict(3) == [30, 11, 10]
    assert c.num_pages == c.num_evictable == 0
    c.check()


def test_a_parent_is_evicted_only_after_its_children() -> None:
    c = RadixCache(PS)
    c.insert([1] * 8, [1, 2])
    c.insert([1] * 4 + [7] * 4, [1, 3])  # splits: [1] -> {[2], [3]}
    c.match([1] * 4)  # touches only the parent: still it must outlive its children
    assert c.evict(2) == [2, 3]
    assert c.evict(1) == [1]
    c.check()


def test_the_check_catches_corruption() -> None:
    c = RadixCache(PS)
    n = c.insert(list(range(8)), [1, 2]).node
    c.check()
    n.ref = 1
    with pytest.raises(KVIntegrityError, match="ref 1"):
        c.check()
    n.ref = 0
    c.num_pages += 1
    with pytest.raises(KVIntegrityError, match="counts"):
        c.check()
    c.num_pages -= 1
    c.insert([9] * 4, [2])  # a page already held by another node
    with pytest.raises(KVIntegrityError, match="page 2 is held by two nodes"):
        c.check()


def test_naive_cache_caches_nothing() -> None:
    c = create_prefix_cache("naive", PS)
    assert isinstance(c, NaiveCache)
    assert c.insert(list(range(8)), [1, 2]).pages == [] and c.match(list(range(8))).pages == []
    assert (c.num_pages, c.num_evictable, c.evict(5)) == (0, 0, [])
    with pytest.raises(ValueError, match="unknown cache type"):
        create_prefix_cache("lru", PS)


# -- a model-based property test ------------------------------------------------------------------
# The reference: a dict from each cached page's token prefix (all tokens up to the end of that page)
# to the page. The tree must answer every match like the dict, keep the dict prefix-closed under
# eviction, never evict a locked path, and hand out each page once.

_TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=6 * PS)  # 3 symbols: many shared prefixes
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), _TOKENS),
        st.tuples(st.just("match"), _TOKENS),
        st.tuples(st.just("lock"), _TOKENS),
        st.tuples(st.just("unlock"), st.integers(0, 10)),
        st.tuples(st.just("evict"), st.integers(1, 6)),
    ),
    max_size=40,
)


def _ref_match(ref: dict[tuple[int, ...], int], ids: list[int]) -> list[int]:
    pages = []
    for k in range(1, len(ids) // PS + 1):
        page = ref.get(tuple(ids[: k * PS]))
        if page is None:
            break
        pages.append(page)
    return pages


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_OPS)
def test_the_tree_behaves_like_a_dict_of_page_prefixes(ops: list[tuple[str, object]]) -> None:
    c = RadixCache(PS)
    ref: dict[tuple[int, ...], int] = {}
    locks: list = []  # (node, pinned prefixes)
    next_page = 0
    for op, arg in ops:
        if op == "insert":
            ids = list(arg)
            n = len(ids) // PS
            mine = list(range(next_page, next_page + n))
            next_page += n
            got = c.insert(ids, mine).pages
            for k in range(1, n + 1):
                ref.setdefault(tuple(ids[: k * PS]), mine[k - 1])
            assert got == _ref_match(ref, ids)
        elif op in ("match", "lock"):
            ids = list(arg)
            m = c.match(ids)
            assert m.pages == _ref_match(ref, ids)
            if op == "lock":
                c.lock(m.node)
                locks.append((m.node, [tuple(ids[: k * PS]) for k in range(1, len(m.pages) + 1)]))
        elif op == "unlock" and locks:
            node, _ = locks.pop(arg % len(locks))
            c.unlock(node)
        elif op == "evict":
            pinned = {p for _, prefixes in locks for p in prefixes}
            before = c.num_evictable
            evicted = c.evict(arg)
            assert len(evicted) == min(arg, before)
            gone = [k for k, v in ref.items() if v in set(evicted)]
            assert not set(gone) & pinned  # a locked path is never evicted
            for k in gone:
                del ref[k]
            assert all(k[:-PS] in ref for k in ref if len(k) > PS)  # still prefix-closed
        c.check([node for node, _ in locks])
        assert sorted(c.held_pages()) == sorted(ref.values())

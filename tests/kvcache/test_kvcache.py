"""Page allocator and page table: allocation order, freeing, growth, integrity checks."""

from __future__ import annotations

import pytest
import torch

from minisgl.kvcache import (
    KVIntegrityError,
    KVPool,
    OutOfPagesError,
    PageAllocator,
    PageTable,
    kv_bytes_per_page,
)


def test_allocator_is_deterministic_and_reuses_freed_pages() -> None:
    a = PageAllocator(8)
    assert a.alloc(3) == [0, 1, 2]
    assert a.alloc(2) == [3, 4]
    a.free([1, 2])
    assert a.num_free == 5
    assert a.alloc(2) == [1, 2]
    with pytest.raises(OutOfPagesError):
        a.alloc(4)
    assert a.num_free == 3  # a failed alloc takes nothing


def test_allocator_rejects_double_free_and_foreign_pages() -> None:
    a = PageAllocator(4)
    pages = a.alloc(2)
    a.free(pages)
    with pytest.raises(ValueError, match="freed twice"):
        a.free([pages[0]])
    with pytest.raises(ValueError, match="not in the pool"):
        a.free([7])


def test_page_table_grows_and_frees_without_leaks() -> None:
    a = PageAllocator(10)
    t = PageTable(a, page_size=4, max_rows=3, max_seq_len=40)
    r0, r1 = t.alloc_row(100), t.alloc_row(101)
    assert t.reserve(r0, 5)  # 2 pages
    assert t.reserve(r1, 4)  # 1 page
    assert t.reserve(r0, 8)  # still 2 pages
    assert t.row_pages[r0] == [0, 1] and t.row_pages[r1] == [2]
    assert t.reserve(r0, 9)  # a third page
    assert t.table[r0, :3].tolist() == [0, 1, 3]
    assert not t.reserve(r1, 4 * 8)  # needs 7 more, 6 free: refused, nothing taken
    assert a.num_free == 6
    t.check_integrity({100, 101})
    t.free_row(r0)
    t.free_row(r1)
    assert a.num_free == 10 and t.num_free_rows == 3
    t.check_integrity(set())


def test_integrity_check_catches_a_leaked_page_and_a_dead_owner() -> None:
    a = PageAllocator(6)
    t = PageTable(a, page_size=2, max_rows=2, max_seq_len=8)
    row = t.alloc_row(7)
    t.reserve(row, 4)
    t.check_integrity({7})
    a.alloc(1)  # taken from the allocator but recorded in no page table: a leak
    with pytest.raises(KVIntegrityError, match="page 2 is allocated but owned by 0"):
        t.check_integrity({7})
    a.free([2])
    with pytest.raises(KVIntegrityError, match="uid 7, which is no longer live"):
        t.check_integrity(set())


def test_integrity_check_catches_a_free_page_in_use_and_a_share_the_cache_lost() -> None:
    a = PageAllocator(6)
    t = PageTable(a, page_size=2, max_rows=2, max_seq_len=8)
    row = t.alloc_row(7)
    t.reserve(row, 4)  # pages 0 and 1
    a.free([1])  # freed behind the row's back: free but still owned
    with pytest.raises(KVIntegrityError, match="page 1 is free but owned by 1 request"):
        t.check_integrity({7})
    b = PageTable(PageAllocator(6), page_size=2, max_rows=2, max_seq_len=8)
    b.alloc_row(8, shared_pages=[0])  # a shared prefix page the cache no longer holds
    with pytest.raises(KVIntegrityError, match="row 0 shares page 0, which the prefix cache does not hold"):
        b.check_integrity({8}, cached_pages=[])


def test_pool_store_and_padding_page() -> None:
    pool = KVPool(
        num_layers=2, num_pages=3, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu"
    )
    assert pool.k[0].shape == (16, 2, 8)
    assert torch.count_nonzero(pool.k[1][pool.pad_slot :]) == 0
    k = torch.randn(2, 2, 8)
    pool.store(1, torch.tensor([5, 9]), k, -k)
    assert torch.equal(pool.k[1][9], k[1]) and torch.equal(pool.v[1][5], -k[0])
    assert kv_bytes_per_page(2, 2, 8, 4, torch.float32) == 2 * 2 * 2 * 8 * 4 * 4

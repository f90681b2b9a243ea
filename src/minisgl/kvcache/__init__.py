"""minisgl.kvcache: the paged KV pool, its page allocator, the per-request page tables and the prefix
caches (radix, naive).

Only the cache types' names load with the package (the configs check them without torch); the rest
loads on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from .allocator import OutOfPagesError, PageAllocator
    from .page_table import KVIntegrityError, PageTable
    from .pool import KVPool, kv_bytes_per_page
    from .prefix import NaiveCache, PrefixCache, create_prefix_cache
    from .radix import PrefixMatch, RadixCache, RadixNode, path_pages

__all__ = [
    "CACHE_TYPES",
    "KVIntegrityError",
    "KVPool",
    "NaiveCache",
    "OutOfPagesError",
    "PageAllocator",
    "PageTable",
    "PrefixCache",
    "PrefixMatch",
    "RadixCache",
    "RadixNode",
    "create_prefix_cache",
    "kv_bytes_per_page",
    "path_pages",
]

CACHE_TYPES = ("radix", "naive")

__getattr__ = lazy_exports(
    __name__,
    {
        "KVIntegrityError": ".page_table",
        "KVPool": ".pool",
        "NaiveCache": ".prefix",
        "OutOfPagesError": ".allocator",
        "PageAllocator": ".allocator",
        "PageTable": ".page_table",
        "PrefixCache": ".prefix",
        "PrefixMatch": ".radix",
        "RadixCache": ".radix",
        "RadixNode": ".radix",
        "create_prefix_cache": ".prefix",
        "kv_bytes_per_page": ".pool",
        "path_pages": ".radix",
    },
)

"""minisgl.kvcache: the paged KV pool, its page allocator, the per-request page tables and the prefix
caches (radix, naive)."""

from .allocator import OutOfPagesError, PageAllocator
from .page_table import KVIntegrityError, PageTable
from .pool import KVPool, kv_bytes_per_page
from .prefix import CACHE_TYPES, NaiveCache, PrefixCache, create_prefix_cache
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

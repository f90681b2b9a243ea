"""minisgl.kvcache: the paged KV pool, its page allocator and the per-request page tables."""

from .allocator import OutOfPagesError, PageAllocator
from .page_table import KVIntegrityError, PageTable
from .pool import KVPool, kv_bytes_per_page

__all__ = ["KVIntegrityError", "KVPool", "OutOfPagesError", "PageAllocator", "PageTable", "kv_bytes_per_page"]

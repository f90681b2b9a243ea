"""The paged KV pool: per layer, one K and one V buffer of `num_pages * page_size` token slots.

Layout per layer: (num_slots + page_size, Hkv, D). The extra last page is a zeroed padding page:
attention backends point padded gather positions at it, so uninitialised memory never reaches a
softmax (masked garbage can be NaN, and NaN survives a -inf mask).
"""

from __future__ import annotations

import torch


def kv_bytes_per_page(
    num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype
) -> int:
    """Bytes one page costs across all layers (K and V)."""
    return 2 * num_layers * num_kv_heads * head_dim * page_size * torch.empty((), dtype=dtype).element_size()


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.pad_slot = self.num_slots  # first slot of the zeroed padding page
        shape = (self.num_slots + page_size, num_kv_heads, head_dim)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for _ in range(num_layers):
            k = torch.empty(shape, dtype=dtype, device=device)
            v = torch.empty(shape, dtype=dtype, device=device)
            k[self.num_slots :].zero_()
            v[self.num_slots :].zero_()
            self.k.append(k)
            self.v.append(v)

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V (rounded to the pool's dtype). slots: (T,) int64; k/v: (T, Hkv, D)."""
        self.k[layer_id].index_copy_(0, slots, k.to(self.dtype))
        self.v[layer_id].index_copy_(0, slots, v.to(self.dtype))

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

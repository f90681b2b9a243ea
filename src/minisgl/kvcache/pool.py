"""The paged KV pool: per layer, one K and one V buffer of `num_pages * page_size` token slots.

Layout per layer: (num_slots + page_size, Hkv, D). The extra last page is a zeroed padding page:
attention backends point padded gather positions at it, so uninitialised memory never reaches a
softmax (masked garbage can be NaN, and NaN survives a -inf mask).

An fp8 pool (dtype float8_e4m3fn, `--kv-cache-dtype fp8_e4m3`) stores `value / scale` rounded to
fp8, with `scales[layer]` (2, Hkv) float32: K's and V's scale per KV head (a checkpoint's per-tensor
scale spread over the heads; 1 where it gives none). Readers multiply back (`load`; the Triton
kernels fold the scales into their softmax scale and output). Its V is stored by page transposed,
(num_pages + 1, Hkv, D, page_size): a page's tokens side by side for each head and channel, so the
attention kernels' V tiles reach the tensor cores with their token axis contiguous, the axis an
(attention weights x V) product runs along; an 8-bit tile laid the other way can only be
transposed on its way there a byte at a time. K keeps the slot-major layout.
"""

from __future__ import annotations

import torch

FP8_KV = torch.float8_e4m3fn
_FP8_MAX = 448.0


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
        scales: list[torch.Tensor] | None = None,
        value_dtype: torch.dtype | None = None,
    ) -> None:
        """`scales`: an fp8 pool's (2, Hkv) float32 per layer (default ones); `value_dtype`: the dtype
        K/V are written and read in (the model's; default `dtype`)."""
        self.num_layers = num_layers
        self.dtype = dtype
        self.value_dtype = value_dtype or dtype
        self.quantized = dtype == FP8_KV
        self.scales: list[torch.Tensor] | None = None
        if self.quantized:
            ones = [torch.ones(2, num_kv_heads, dtype=torch.float32) for _ in range(num_layers)]
            self.scales = [s.to(device, torch.float32).contiguous() for s in scales or ones]
            if len(self.scales) != num_layers or any(s.shape != (2, num_kv_heads) for s in self.scales):
                raise ValueError(f"KVPool: fp8 scales must be {num_layers} tensors of (2, {num_kv_heads})")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.pad_slot = self.num_slots  # first slot of the zeroed padding page
        shape = (self.num_slots + page_size, num_kv_heads, head_dim)
        v_shape = (num_pages + 1, num_kv_heads, head_dim, page_size) if self.quantized else shape
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        # An fp8 pool starts zeroed: its kernels read whole pages of V, and what lies past a request's
        # end must be finite (uninitialised bytes can be fp8 NaNs; every write saturates).
        alloc = torch.zeros if self.quantized else torch.empty
        for _ in range(num_layers):
            k = alloc(shape, dtype=dtype, device=device)
            v = alloc(v_shape, dtype=dtype, device=device)
            k[self.num_slots :].zero_()
            v[num_pages if self.quantized else self.num_slots :].zero_()
            self.k.append(k)
            self.v.append(v)

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V (rounded to the pool's dtype). slots: (T,) int64; k/v: (T, Hkv, D)."""
        if self.scales is None:
            self.k[layer_id].index_copy_(0, slots, k.to(self.dtype))
            self.v[layer_id].index_copy_(0, slots, v.to(self.dtype))
            return
        scale = self.scales[layer_id][:, None, :, None]  # (2, 1, Hkv, 1)
        k = (k.float() / scale[0]).clamp(-_FP8_MAX, _FP8_MAX).to(self.dtype)
        v = (v.float() / scale[1]).clamp(-_FP8_MAX, _FP8_MAX).to(self.dtype)
        # as bytes: torch's index ops do not take fp8
        self.k[layer_id].view(torch.uint8).index_copy_(0, slots, k.view(torch.uint8))
        page, off = slots // self.page_size, slots % self.page_size
        self.v[layer_id].view(torch.uint8)[page, :, :, off] = v.view(torch.uint8)  # V by page, transposed

    def load(
        self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` (N,) int64 as `dtype` values (N, Hkv, D), dequantized from an fp8 pool."""
        if self.scales is None:
            k, v = self.k[layer_id], self.v[layer_id]
            return k.index_select(0, slots).to(dtype), v.index_select(0, slots).to(dtype)
        k = self.k[layer_id].view(torch.uint8).index_select(0, slots).view(self.dtype)
        page, off = slots // self.page_size, slots % self.page_size
        v = self.v[layer_id].view(torch.uint8)[page, :, :, off].view(self.dtype)  # (N, Hkv, D)
        scale = self.scales[layer_id][:, None, :, None]  # (2, 1, Hkv, 1)
        return (k.float() * scale[0]).to(dtype), (v.float() * scale[1]).to(dtype)

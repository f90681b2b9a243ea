"""Where a paged KV pool's V lives, in either of its layouts: slot-major ((slots, Hkv, D), as K) or by
page transposed (an fp8 pool: (pages, Hkv, D, PS), a page's positions contiguous for each channel, so
that P @ V reads them as the tensor cores' K-major operand). Shared by the attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def v_at(VCache, page, off, head, d, stride_cs, stride_ch, stride_vp, D: tl.constexpr, PS: tl.constexpr,
          V_T: tl.constexpr):  # fmt: skip
    """Pointers to V of slot page * PS + off, head, channel d, in either layout (slot-major, or by
    page transposed)."""
    if V_T:
        return VCache + page * stride_vp + head * (D * PS) + d * PS + off
    return VCache + (page * PS + off) * stride_cs + head * stride_ch + d


@triton.jit
def v_pages(VCache, pt_row, n0, end, head, stride_vp, D: tl.constexpr, BLOCK_D: tl.constexpr, PS: tl.constexpr,
            BLOCK_N: tl.constexpr):  # fmt: skip
    """V (BLOCK_N, BLOCK_D) of positions [n0, n0 + BLOCK_N) (n0 and BLOCK_N multiples of PS) from a pool
    by page transposed, whole pages that start below `end`. Loaded as a (channels, pages, PS) tile,
    so that a warp's lanes read one page's neighbouring channels (512 contiguous bytes of an fp8 pool)
    where a (BLOCK_N, BLOCK_D) tile puts them along the positions first (16 bytes from each of four
    pages a quarter-warp). Which is faster depends on the launch: `attention.fp8_v_pages`."""
    NP: tl.constexpr = BLOCK_N // PS
    first = n0 + tl.arange(0, NP) * PS  # (NP,) each page's first position
    page_ok = first < end
    pages = tl.load(pt_row + first // PS, mask=page_ok, other=0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_o = tl.arange(0, PS)
    in_page = offs_d[:, None, None] * PS + offs_o[None, None, :]  # (BLOCK_D, 1, PS)
    ptr = VCache + head * (D * PS) + pages[None, :, None] * stride_vp + in_page  # (BLOCK_D, NP, PS)
    v = tl.load(ptr, mask=(offs_d < D)[:, None, None] & page_ok[None, :, None], other=0.0)
    return tl.reshape(tl.permute(v, (1, 2, 0)), (BLOCK_N, BLOCK_D))

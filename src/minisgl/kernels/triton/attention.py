"""Paged attention in Triton: the KV write, a decode kernel and a varlen prefill/extend kernel.

The KV pool holds, per layer, K and V as (slots, Hkv, D); token `i` of the request whose page-table
row is `r` lives in slot `pages[r, i // PS] * PS + i % PS`. Kernels gather K/V through the page
table themselves, so nothing is copied or padded on the host. V may also come by page transposed,
(pages, Hkv, D, PS) (a 4-d cache: the fp8 pool's, see `minisgl.kvcache.pool`): the same slot is
page `slot // PS`, column `slot % PS`.

- `store_kv`: the new tokens' K/V into their slots (a slot < 0 is skipped: padding rows of a
  CUDA-graph batch write nothing).
- `decode_attention`: one query token per request. Grid (B, Hkv, splits): a KV head's G query heads
  are one (G padded to 16) x D tile, so grouped-query attention reads each K/V block once, without
  expansion; the context is split over `splits` programs (split-KV, for long contexts and small
  batches) whose partial results (output and log-sum-exp) the last of them to finish merges. Given the new
  token's K/V, it also stores them (the split-0 program of each head writes its slot) and reads them
  from the inputs rather than the pool, so no program reads a slot being written: one kernel fewer
  per layer than a separate `store_kv`.
  With splits and the new token given (a decode step), the lengths, the page table and each split's
  first block of K/V are loaded before PDL's wait (the kernel before writes none of them), so they
  stream during that kernel's tail (batch 1, 8B: 8.8 -> 5.9 us a layer with the merge below); the
  last program merges every split in one load (not one round trip each).
- `extend_attention`: any number of new tokens per request over its cached prefix, causal, all
  requests of the batch in one launch. Grid (query blocks, Hq, B); K/V come from the pool (the new
  tokens' K/V are stored first), so fresh prompts and chunks over a prefix take the same path.

Math in float32 with an online softmax; bf16/fp16 inputs go to the tensor cores through `tl.dot`
(float32 inputs use full-precision dots, not TF32).

An fp8 pool (float8_e4m3fn, with `scales` (k_scale, v_scale), each (Hkv,) float32: value ~= stored *
scale): the writers store value / scale rounded to fp8; the readers widen K/V tiles to q's dtype for
the dots and fold the scales in, K's into the softmax scale and V's into the output, so the scales cost
no arithmetic per element. The decode kernel attends over the new token as stored (rounded), as the
next step will read it. With 16-bit q the dots of an fp8 cache run in fp16 (q converted once per
program, each fp8 pair widened in one instruction; q, p in [0, 1] and fp8's +-448 all fit fp16);
MINISGL_FP8_ATTN_DOT=bf16 takes bf16 through `fp8.widen_fp8` instead (for measurements).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .decode import decode_packed, packed_heads, packed_maxnreg
from .fp8 import WIDEN, quantize_fp8, widen_fp8
from .kv_pages import v_at as _v_at
from .kv_pages import v_pages as _v_pages
from .pdl import pdl_enter, pdl_launch, use_pdl

_FP8_DOT_BF16 = os.environ.get("MINISGL_FP8_ATTN_DOT") == "bf16"
_PREWAIT = os.environ.get("MINISGL_DECODE_PREWAIT", "1") != "0"  # 0: every load after PDL's wait (A/B)
# The decode grid's order: a request's KV heads side by side (1, the default) or every request of
# one KV head before the next head (0, the old order; for A/B).
_HEADS_FIRST = os.environ.get("MINISGL_DECODE_HEADS_FIRST", "1") != "0"
# An fp8 pool at one split: the registers a thread at most (ptxas' maxnreg; 0: the compiler's choice).
# At 8B's shapes the kernel takes 119 registers, 4 programs (16 warps) a multiprocessor; at 80, 6
# programs (24 warps) with no spill inside the loop (static count of Triton 3.9's code for sm_90).
# Left off: on an H200, contexts spread, 80 gave 127.4 against 132.4 us at batch 192 but 94.8 against
# 90.1 at 128 and 93.3 against 71.6 at 96, and the throughput workload's decode step 8.88 ms either way.
_FP8_MAXNREG = int(os.environ.get("MINISGL_FP8_ATTN_MAXNREG", "0"))
# > 0: the decode kernel moves its running max only when a row's grows by more than this (`_scores`).
_LAZY = float(os.environ.get("MINISGL_DECODE_LAZY", "0"))
# The one-head decode kernel over an fp8 pool (V by page transposed), where `fp8_v_pages` says: 1
# (default) V read in page rows (`kv_pages.v_pages`) with the launch FP8_V_PAGES_LAUNCH; 0 always a
# (positions, channels) tile with (64, 4, 2), as before (A/B).
_FP8_V_PAGES = os.environ.get("MINISGL_FP8_V_PAGES", "1") != "0"
FP8_V_PAGES_LAUNCH = (32, 2, 4)


def fp8_v_pages(bsz: int, num_splits: int) -> bool:
    """Whether the one-head kernel reads an fp8 pool's V in page rows: at two splits from 48 requests,
    at one from 128. H200, 8B heads, contexts 300-1300 longest first (`bench_decode_attention.py`),
    (32, 2, 4) in page rows against (64, 4, 2) as a tile: two splits, batch 32 38.8 / 34.0 us, 48
    44.7 / 43.2 (contexts 900-1900: 62.6 / 71.7), 64 48.7 / 51.8; one split, batch 96 79.6 / 71.2, 128
    82.1 / 90.6 (81.9 / 90.2 and 82.0 / 90.2 in two other calls). At (64, 4, 2) the page rows lost
    (128: 95.5 / 90.6), as they did in the packed and the extend kernels (204.9 / 196.3 us at batch
    256, 187.1 / 171.5 us), which keep the tile."""
    return _FP8_V_PAGES and ((num_splits == 2 and bsz >= 48) or (num_splits == 1 and bsz >= 128))


@triton.jit
def _v_slot(VCache, slot, head, d, stride_cs, stride_ch, stride_vp, D: tl.constexpr, PS: tl.constexpr,
            V_T: tl.constexpr):  # fmt: skip
    return _v_at(VCache, slot // PS, slot % PS, head, d, stride_cs, stride_ch, stride_vp, D, PS, V_T)


@triton.jit
def _store_kv_kernel(
    K, V, KCache, VCache, Slots, KScale, VScale, stride_k, stride_v, stride_c, stride_vp,
    HD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr, PS: tl.constexpr,
    V_T: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < tl.where(slot >= 0, HD, 0)  # a negative slot: nothing to write
    k = tl.load(K + t * stride_k + offs, mask=mask)
    v = tl.load(V + t * stride_v + offs, mask=mask)
    if QUANT:  # each element's head's scale
        k = quantize_fp8(k, tl.load(KScale + offs // D, mask=mask, other=1.0))
        v = quantize_fp8(v, tl.load(VScale + offs // D, mask=mask, other=1.0))
    tl.store(KCache + slot * stride_c + offs, k, mask=mask)
    tl.store(_v_slot(VCache, slot, offs // D, offs % D, stride_c, D, stride_vp, D, PS, V_T), v, mask=mask)


def _scale_args(
    k_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k_scale, v_scale, quantized) kernel arguments: an fp8 cache needs its (Hkv,) scales."""
    quant = k_cache.dtype == torch.float8_e4m3fn
    if not quant:
        return k_cache, k_cache, False  # unused
    hkv = k_cache.shape[1]
    if scales is None or any(
        s.shape != (hkv,) or s.dtype != torch.float32 or s.stride(0) != 1 for s in scales
    ):
        raise ValueError(f"an fp8 KV cache needs (k_scale, v_scale), each ({hkv},) float32")
    return scales[0], scales[1], True


def _v_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int | None = None) -> tuple[bool, int]:
    """(whether V is by page transposed, its page size; 1 for slot-major V, where it is unused)."""
    if v_cache.dim() == 3:
        if v_cache.shape != k_cache.shape:
            raise ValueError(f"V cache {tuple(v_cache.shape)} against K cache {tuple(k_cache.shape)}")
        return False, 1
    slots, hkv, d = k_cache.shape
    ps = v_cache.shape[3]
    if (
        v_cache.shape != (slots // ps, hkv, d, ps)
        or not v_cache.is_contiguous()
        or page_size not in (None, ps)
    ):
        raise ValueError(f"V cache {tuple(v_cache.shape)} by page against K cache {tuple(k_cache.shape)}")
    return True, ps


def _kv_f16(quant: bool, q: torch.Tensor) -> bool:
    """Whether an fp8 cache's dots run in fp16 (16-bit q), see the module's docstring."""
    return quant and q.dtype != torch.float32 and not _FP8_DOT_BF16


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """k/v (T, Hkv, D) (each token's heads contiguous) -> k_cache/v_cache[slots[t]] for slots >= 0
    (an fp8 cache: value / scale per head, `scales` (k_scale, v_scale) each (Hkv,))."""
    t, hkv, d = k.shape
    if t == 0:
        return
    if k.stride(2) != 1 or k.stride(1) != d or v.stride(2) != 1 or v.stride(1) != d:
        raise ValueError("store_kv: each token's K/V heads must be contiguous")
    k_scale, v_scale, quant = _scale_args(k_cache, scales)
    block = triton.next_power_of_2(hkv * d)
    v_t, ps = _v_layout(k_cache, v_cache)
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slots, k_scale, v_scale, k.stride(0), v.stride(0), k_cache.stride(0),
        v_cache.stride(0), HD=hkv * d, D=d, BLOCK=block, QUANT=quant, PS=ps, V_T=v_t,
        num_warps=max(1, min(8, block // 256)),
    )  # fmt: skip


@triton.jit
def _widen(x, dtype: tl.constexpr, WIDE: tl.constexpr):
    """A K/V tile in the dots' dtype: fp8 -> bf16 through `widen_fp8` (2^-112 times the values) when
    WIDE, else a plain conversion (none for a 16/32-bit cache)."""
    if WIDE:
        return widen_fp8(x)
    return x.to(dtype)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _rotate(x1, x2, cos, sin, ROPE: tl.constexpr):
    """RoPE (rotate-half) on a vector's two halves, in float32, rounded back to their dtype once."""
    if ROPE:
        y1 = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
        y2 = x2.to(tl.float32) * cos + x1.to(tl.float32) * sin
        return y1.to(x1.dtype), y2.to(x2.dtype)
    return x1, x2


@triton.jit
def _head_rstd(x1, x2, eps, D: tl.constexpr):
    """1 / RMS of each head given as two halves (the last axis), in float32: (BLOCK_H,) for (BLOCK_H,
    BLOCK_HALF) halves, a scalar for (BLOCK_HALF,) ones; masked lanes loaded as 0."""
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    return tl.rsqrt((tl.sum(f1 * f1, -1) + tl.sum(f2 * f2, -1)) / D + eps)


@triton.jit
def _head_normed(x, rstd, W, offs, mask):
    """Qwen3's per-head RMSNorm of one half x, rstd broadcast over it, W the half's weights: rounded as
    `elementwise.rope_qkv` (and HF) round it, the normed x to x's dtype before the weight and after."""
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    return (w * (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)


@triton.jit
def _k_block(KCache, pt_row, n0, cached_end, kvh, offs_j, j_mask, stride_cs, stride_ch, D: tl.constexpr,
             PS: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Positions [n0, n0 + BLOCK_N) below cached_end: (pos, their mask, the mask of their pages, the
    pages, K's two halves (BLOCK_N, BLOCK_HALF) each as stored, masked positions 0)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    n_mask = pos < cached_end
    # V by page transposed loads whole pages (a page's tokens are one vector; the positions past
    # the end weigh 0, and an fp8 pool holds no NaN: zeroed at start, written saturating)
    page_mask = (pos // PS) * PS < cached_end
    page = tl.load(pt_row + pos // PS, mask=page_mask, other=0).to(tl.int64)
    slot_off = (page * PS + pos % PS)[:, None] * stride_cs + kvh * stride_ch  # (BLOCK_N, 1)
    k_mask = n_mask[:, None] & j_mask[None, :]
    k1 = tl.load(KCache + slot_off + offs_j[None, :], mask=k_mask, other=0.0)
    k2 = tl.load(KCache + slot_off + D // 2 + offs_j[None, :], mask=k_mask, other=0.0)
    return pos, n_mask, page_mask, page, k1, k2


@triton.jit
def _v_block(VCache, pt_row, n0, end, pos, n_mask, page_mask, page, kvh, offs_d, d_mask, stride_cs, stride_ch,
             stride_vp, D: tl.constexpr, BLOCK_D: tl.constexpr, PS: tl.constexpr, BLOCK_N: tl.constexpr,
             V_T: tl.constexpr, V_PAGES: tl.constexpr):  # fmt: skip
    """V (BLOCK_N, BLOCK_D) of `_k_block`'s positions [n0, n0 + BLOCK_N) below `end`, as stored; V_PAGES
    (with V_T): read in page rows (`kv_pages.v_pages`)."""
    if V_T and V_PAGES and BLOCK_N % PS == 0:
        return _v_pages(VCache, pt_row, n0, end, kvh, stride_vp, D, BLOCK_D, PS, BLOCK_N)
    v_ptr = _v_at(VCache, page[:, None], (pos % PS)[:, None], kvh, offs_d[None, :], stride_cs, stride_ch,
                  stride_vp, D, PS, V_T)  # fmt: skip
    v_mask = (page_mask if V_T else n_mask)[:, None] & d_mask[None, :]
    return tl.load(v_ptr, mask=v_mask, other=0.0)


@triton.jit
def _scores(
    q1, q2, k1, k2, n_mask, m_i, l_i, s_scale, wide: tl.constexpr, IEEE: tl.constexpr, LAZY: tl.constexpr
):
    """The online softmax over one block (at least one position unmasked): (new max, new sum, the
    block's weights p (BLOCK_H, BLOCK_N), the factor alpha for what was summed before, whether alpha
    is not all 1). LAZY: the max is moved only where some row's grows by more than LAZY (in the
    scores' units), so most blocks leave the accumulator as it is (p stays below e^LAZY: exact math,
    the same relative rounding in fp16/bf16)."""
    k1, k2 = _widen(k1, q1.dtype, wide), _widen(k2, q1.dtype, wide)
    s = (_dot(q1, tl.trans(k1), IEEE) + _dot(q2, tl.trans(k2), IEEE)) * s_scale  # (BLOCK_H, BLOCK_N)
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    grow = tl.max(m_new - m_i, 0) > LAZY  # m_i -inf: inf
    if LAZY > 0:
        m_new = tl.where(grow, m_new, m_i)
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha, grow


@triton.jit
def _rescale(acc, alpha, grow, LAZY: tl.constexpr):
    """acc times alpha per row; with LAZY only where `_scores` moved the max (else alpha is all 1)."""
    if LAZY > 0:
        if grow:
            acc = acc * alpha[:, None]
    else:
        acc = acc * alpha[:, None]
    return acc


@triton.jit
def _decode_kernel(
    Q,  # (B, HQ, D) strided: unit stride in D
    KCache,  # (S, HKV, D)
    VCache,
    PageTable,  # (rows, stride_pt) int32
    SeqLens,  # (B,) int32
    KNew,  # HAS_NEW: (B, HKV, D) the new token's K (its heads contiguous), V likewise
    VNew,
    NewSlots,  # HAS_NEW: (B,) int32 pool slot of the new token (< 0: write nothing)
    Cos,  # ROPE: (B, D/2) rows of stride_cs, the new token's angles; Q and KNew are not rotated yet
    Sin,
    QW,  # QK_NORM: (D,) q's per-head RMSNorm weight, applied before the rotation (Qwen3)
    KW,  # QK_NORM: (D,) k's
    KScale,  # QUANT: (HKV,) float32, the fp8 cache's scales
    VScale,
    Out,  # (B, HQ, D)
    Partial,  # NUM_SPLITS > 1: float32 (B, HQ, NUM_SPLITS, D) each split's normalised output
    Lse,  # NUM_SPLITS > 1: float32 (B, HQ, NUM_SPLITS) each split's log-sum-exp
    Done,  # NUM_SPLITS > 1: int32 (B, HKV) splits finished per (request, KV head); zero between launches
    stride_qb,
    stride_qh,
    stride_kn,
    stride_vn,
    stride_cs,
    stride_ch,
    stride_pt,
    stride_rope,
    stride_vp,  # V_T: V's stride between pages
    sm_scale,
    eps,  # QK_NORM: the norms' epsilon
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_NEW: tl.constexpr,
    ROPE: tl.constexpr,
    QK_NORM: tl.constexpr,
    QUANT: tl.constexpr,
    KV_F16: tl.constexpr,
    V_T: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    PEEL: tl.constexpr,  # the first block loaded before the wait (see below)
    BLOCK_G: tl.constexpr,  # the merge's heads at a time
    BLOCK_S: tl.constexpr,  # NUM_SPLITS padded to a power of two
    HEADS_FIRST: tl.constexpr,  # grid (Hkv, B, splits): a request's heads launch one after the other
    LAZY: tl.constexpr = 0.0,  # > 0: `_scores`' lazy rescaling
    V_PAGES: tl.constexpr = False,  # with V_T: V read in page rows (`_v_block`)
):
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        num_kvh = tl.num_programs(0)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        num_kvh = tl.num_programs(1)
    split = tl.program_id(2)
    # PEEL: what the kernel before cannot have written (seq_lens, the page table, the pool's cached
    # positions: all written before the step's first kernel) is loaded before PDL's wait, the split's
    # first block of K/V included, so those loads stream during that kernel's tail; q, the new K/V and
    # the split counters after it. Only with new_kv (without, the pool's last position may be the
    # kernel before's) and with splits (one split a row is a large batch: a long loop, and the first
    # block peeled off made it slower, 287 against 257 us at batch 256, context 1024).
    pdl_enter(PDL and not PEEL)
    seq_len = tl.load(SeqLens + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    # With HAS_NEW the newest position comes from the inputs (its slot is being written): the loop
    # reads the pool up to it, and the split that holds it folds it in after the loop.
    cached_end = tl.minimum(end, seq_len - 1) if HAS_NEW else end
    HALF: tl.constexpr = D // 2
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_j = tl.arange(0, BLOCK_HALF)  # q and k are handled as two halves: RoPE pairs j with j + D/2
    j_mask = offs_j < HALF
    pt_row = PageTable + b.to(tl.int64) * stride_pt
    if PEEL:
        pos0, n_mask0, page_mask0, page0, k01, k02 = _k_block(KCache, pt_row, start, cached_end, kvh, offs_j, j_mask,
                                                              stride_cs, stride_ch, D, PS, BLOCK_N)  # fmt: skip
        v0 = _v_block(VCache, pt_row, start, cached_end, pos0, n_mask0, page_mask0, page0, kvh, offs_d, d_mask,
                      stride_cs, stride_ch, stride_vp, D, BLOCK_D, PS, BLOCK_N, V_T, V_PAGES)  # fmt: skip
    pdl_enter(PDL and PEEL)
    # An fp8 cache: scores and outputs in the cache's units, scaled once; the dots in fp16 (KV_F16)
    # or, for bf16 q, in `widen_fp8`'s units (the tiles 2^-112 times their values: `unit` puts it back).
    wide: tl.constexpr = QUANT and not KV_F16 and Q.dtype.element_ty == tl.bfloat16
    unit = WIDEN if wide else 1.0
    if QUANT:
        k_scale = tl.load(KScale + kvh)
        v_scale = tl.load(VScale + kvh)
    else:
        k_scale = 1.0
        v_scale = 1.0
    qk_scale = sm_scale * k_scale
    if ROPE:
        cos = tl.load(Cos + b.to(tl.int64) * stride_rope + offs_j, mask=j_mask, other=1.0).to(tl.float32)
        sin = tl.load(Sin + b.to(tl.int64) * stride_rope + offs_j, mask=j_mask, other=0.0).to(tl.float32)
    else:
        cos = tl.full([BLOCK_HALF], 1.0, tl.float32)
        sin = tl.zeros([BLOCK_HALF], tl.float32)

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    q_ptr = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_j[None, :]
    q_mask = h_mask[:, None] & j_mask[None, :]
    q1 = tl.load(q_ptr, mask=q_mask, other=0.0)  # (BLOCK_H, BLOCK_HALF) each
    q2 = tl.load(q_ptr + HALF, mask=q_mask, other=0.0)
    if QK_NORM:
        rstd = _head_rstd(q1, q2, eps, D)[:, None]
        q1, q2 = _head_normed(q1, rstd, QW, offs_j, j_mask), _head_normed(q2, rstd, QW + HALF, offs_j, j_mask)
    q1, q2 = _rotate(q1, q2, cos[None, :], sin[None, :], ROPE)
    if KV_F16:
        q1, q2 = q1.to(tl.float16), q2.to(tl.float16)

    v_new = VNew + b.to(tl.int64) * stride_vn + kvh * D + offs_d  # (BLOCK_D,) pointers
    if HAS_NEW:
        k_new = KNew + b.to(tl.int64) * stride_kn + kvh * D + offs_j
        kn1, kn2 = tl.load(k_new, mask=j_mask, other=0.0), tl.load(k_new + HALF, mask=j_mask, other=0.0)
        if QK_NORM:
            rstd_k = _head_rstd(kn1, kn2, eps, D)
            kn1, kn2 = (
                _head_normed(kn1, rstd_k, KW, offs_j, j_mask),
                _head_normed(kn2, rstd_k, KW + HALF, offs_j, j_mask),
            )
        kn1, kn2 = _rotate(kn1, kn2, cos, sin, ROPE)
        if QUANT:  # as the pool will hold it
            kn1 = quantize_fp8(kn1, k_scale)
            kn2 = quantize_fp8(kn2, k_scale)
        if split == 0:  # this head's new K/V into the pool
            new_slot = tl.load(NewSlots + b).to(tl.int64)
            dst = KCache + new_slot * stride_cs + kvh * stride_ch
            w_mask = offs_j < tl.where(new_slot >= 0, HALF, 0)  # a negative slot: nothing to write
            tl.store(dst + offs_j, kn1, mask=w_mask)
            tl.store(dst + HALF + offs_j, kn2, mask=w_mask)
            v_mask = offs_d < tl.where(new_slot >= 0, D, 0)
            dst = _v_slot(VCache, new_slot, kvh, offs_d, stride_cs, stride_ch, stride_vp, D, PS, V_T)
            vn = tl.load(v_new, mask=v_mask)
            if QUANT:
                vn = quantize_fp8(vn, v_scale)
            tl.store(dst, vn, mask=v_mask)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    s_scale = qk_scale * unit
    loop_start = start
    if PEEL:
        loop_start = start + BLOCK_N
        if start < cached_end:  # the first block, loaded before the wait
            m_i, l_i, p, alpha, grow = _scores(q1, q2, k01, k02, n_mask0, m_i, l_i, s_scale, wide, IEEE, LAZY)
            v = _widen(v0, q1.dtype, wide)
            acc = _rescale(acc, alpha, grow, LAZY) + _dot(p.to(v.dtype), v, IEEE)  # in `unit`s
    for n0 in range(loop_start, cached_end, BLOCK_N):
        pos, n_mask, page_mask, page, k1, k2 = _k_block(KCache, pt_row, n0, cached_end, kvh, offs_j, j_mask,
                                                        stride_cs, stride_ch, D, PS, BLOCK_N)  # fmt: skip
        m_i, l_i, p, alpha, grow = _scores(q1, q2, k1, k2, n_mask, m_i, l_i, s_scale, wide, IEEE, LAZY)
        v = _widen(_v_block(VCache, pt_row, n0, cached_end, pos, n_mask, page_mask, page, kvh, offs_d, d_mask,
                            stride_cs, stride_ch, stride_vp, D, BLOCK_D, PS, BLOCK_N, V_T, V_PAGES), q1.dtype,
                   wide)  # fmt: skip
        acc = _rescale(acc, alpha, grow, LAZY) + _dot(p.to(v.dtype), v, IEEE)
    if HAS_NEW:
        if (start <= seq_len - 1) & (seq_len - 1 < end):
            s_new = tl.sum(q1.to(tl.float32) * kn1.to(tl.float32)[None, :], 1)
            s_new = (s_new + tl.sum(q2.to(tl.float32) * kn2.to(tl.float32)[None, :], 1)) * qk_scale
            m_new = tl.maximum(m_i, s_new)  # (BLOCK_H,)
            alpha = tl.exp(m_i - m_new)
            p_new = tl.exp(s_new - m_new)
            l_i = l_i * alpha + p_new
            vn = tl.load(v_new, mask=d_mask, other=0.0)
            if QUANT:
                vn = quantize_fp8(vn, v_scale)
            acc = acc * alpha[:, None] + p_new[:, None] * (vn.to(tl.float32) * (1.0 / unit))[None, :]
            m_i = m_new

    has = end > start
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = tl.where(has, acc * (v_scale * unit / safe_l)[:, None], 0.0)
    out_mask = h_mask[:, None] & d_mask[None, :]
    row = b.to(tl.int64) * (GROUP * num_kvh) + heads  # (BLOCK_H,) flat (b, head)
    if NUM_SPLITS == 1:
        tl.store(Out + row[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(has, m_i + tl.log(safe_l), float("-inf"))
        tl.store(Partial + (row[:, None] * NUM_SPLITS + split) * D + offs_d[None, :], out, mask=out_mask)
        tl.store(Lse + row * NUM_SPLITS + split, lse, mask=h_mask)
        # The last program of this (request, KV head) to finish merges every split: no second kernel.
        # The barrier orders this program's stores before its release; the acquire orders the
        # other programs' stores before the loads below.
        tl.debug_barrier()
        counter = Done + b * num_kvh + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
            tl.store(counter, 0)  # ready for the next launch (kernel boundaries order it)
            first = b.to(tl.int64) * (GROUP * num_kvh) + kvh * GROUP
            _merge_splits(Partial, Lse, Out, first, GROUP, NUM_SPLITS, D, BLOCK_G, BLOCK_S, BLOCK_D)


@triton.jit
def _merge_splits(Partial, Lse, Out, first_row, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, D: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Out of the GROUP rows from first_row = the splits' outputs weighted by their softmax mass (exp
    of their log-sum-exp): every split of BLOCK_G heads loaded at once (one round trip to the L2, not
    one per split)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    for g0 in tl.static_range(0, GROUP, BLOCK_G):
        g_mask = g0 + offs_g < GROUP
        row = first_row + g0 + offs_g  # (BLOCK_G,)
        gs_mask = g_mask[:, None] & (offs_s < NUM_SPLITS)[None, :]
        lse = tl.load(
            Lse + row[:, None] * NUM_SPLITS + offs_s[None, :],
            mask=gs_mask,
            other=float("-inf"),
            cache_modifier=".cg",
        )  # fmt: skip  (BLOCK_G, BLOCK_S)
        part_ptr = (
            Partial + (row[:, None, None] * NUM_SPLITS + offs_s[None, :, None]) * D + offs_d[None, None, :]
        )
        part = tl.load(
            part_ptr, mask=gs_mask[:, :, None] & (offs_d < D)[None, None, :], other=0.0, cache_modifier=".cg"
        )  # fmt: skip  (BLOCK_G, BLOCK_S, BLOCK_D)
        m = tl.max(lse, 1)
        w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m)[:, None])  # no split with keys: weights 0
        den = tl.sum(w, 1)
        out = tl.sum(w[:, :, None] * part, 1) / tl.where(den > 0, den, 1.0)[:, None]  # (BLOCK_G, BLOCK_D)
        mask = g_mask[:, None] & (offs_d < D)[None, :]
        tl.store(Out + row[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty), mask=mask)


def decode_splits(batch_size: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Programs per (request, KV head) so that a decode step fills the GPU: about two waves of
    (B * Hkv * splits) programs over the multiprocessors, at most `max_splits`; and two splits while
    one would leave at most four programs a multiprocessor (8B shapes on an H200, batch 48, contexts
    904-1918: 73 us with two against 95 with one, the batch longest first; at batch 96, 131 against
    128, so one stays there)."""
    rows = max(1, batch_size * num_kv_heads)
    want = triton.cdiv(2 * num_sms, rows)
    if rows <= 4 * num_sms:
        want = max(want, 2)
    return max(1, min(max_splits, triton.next_power_of_2(want)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    done: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    launch: tuple[int, ...] | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    heads_first: bool | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """q (B, Hq, D) (unit stride in D, D even); k/v_cache (S, Hkv, D) contiguous; page_table (>= B, P)
    int32 (unit stride in P); seq_lens (B,) int32 (0: an empty row, output 0) -> (B, Hq, D) in q's dtype.

    new_kv: (k, v, slots) of the new tokens, k/v (B, Hkv, D) with each token's heads contiguous,
    slots (B,) int32: stored into the pool by this kernel (slot < 0: not stored) and used for each
    request's last position. Without it, the pool must already hold every position.
    done: int32 zeros, at least B * Hkv (the split counters; left zeroed): a buffer kept across calls
    (a CUDA graph's), else one is allocated.
    rope: (cos, sin), each (B, D/2) or (B, 1, D/2) with unit stride in D/2: q and the new k are given
    before RoPE and the kernel rotates them (rotate-half, rounded once to q's dtype, as
    `elementwise.rope_qkv` does), so q/k/v may be views of the fused projection's output.
    launch: (BLOCK_N, num_warps, num_stages[, kv_heads[, maxnreg]]), for benchmarks; default (64 or 32
    by D, 4, 2); kv_heads 0 takes the one-head kernel, >= 1 `decode.packed`'s with that many KV heads a
    program (default: `packed_heads`); maxnreg the registers a thread at most, 0 unbounded (default:
    for an fp8 pool at one split MINISGL_FP8_ATTN_MAXNREG, or `packed_maxnreg` for the packed kernel, else
    unbounded).
    scales: an fp8 cache's (k_scale, v_scale), each (Hkv,) float32.
    heads_first: the grid's order, for benchmarks (default MINISGL_DECODE_HEADS_FIRST, on): a
    request's KV heads are neighbouring programs, so the GPU starts them together (they read the same
    token rows of the pool) and a batch ordered longest first starts its longest requests first.
    qk_norm: with rope, (q's weight (D,), k's weight (D,), eps): each q head and the new k heads
    RMSNormed before the rotation (Qwen3), rounded as `elementwise.rope_qkv` rounds them; it takes the
    one-head kernel (the packed one has no norm)."""
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    if hq % hkv or k_cache.shape[2] != d or d % 2 or q.stride(2) != 1 or page_table.stride(1) != 1:
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    group = hq // hkv
    if out is None:
        out = q.new_empty(bsz, hq, d)
    if bsz == 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))  # tl.dot needs dimensions >= 16
    k_scale, v_scale, quant = _scale_args(k_cache, scales)
    v_t = _v_layout(k_cache, v_cache, page_size)[0]
    v_pages = v_t and fp8_v_pages(bsz, num_splits)
    default = FP8_V_PAGES_LAUNCH if v_pages else (64 if block_d <= 128 else 32, 4, 2)
    block_n, warps, stages = (launch or ())[:3] or default
    ieee = q.dtype == torch.float32
    if new_kv is not None:
        k_new, v_new, slots = new_kv
        if k_new.shape != (bsz, hkv, d) or k_new.stride()[1:] != (d, 1) or v_new.stride()[1:] != (d, 1):
            raise ValueError(f"decode_attention: new K/V {tuple(k_new.shape)} for ({bsz}, {hkv}, {d})")
    else:
        if rope is not None:
            raise ValueError("decode_attention: rope needs new_kv (the new token's K to rotate)")
        k_new = v_new = q
        slots = seq_lens
    if qk_norm is not None and rope is None:
        raise ValueError("decode_attention: qk_norm comes with rope (the norms precede the rotation)")
    qw, kw, eps = qk_norm if qk_norm is not None else (q, q, 0.0)
    if rope is None:
        cos = sin = q  # unused
    else:
        cos, sin = rope[0].reshape(bsz, d // 2), rope[1].reshape(bsz, d // 2)
        if cos.stride(1) != 1 or sin.stride() != cos.stride():
            raise ValueError(f"decode_attention: cos/sin {tuple(rope[0].shape)} for ({bsz}, {d // 2})")
    if num_splits == 1:
        partial = lse = done = out  # unused
    else:
        partial = torch.empty(bsz, hq, num_splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
        if done is None:
            done = torch.zeros(bsz * hkv, dtype=torch.int32, device=q.device)
    pdl = use_pdl(q)
    first = _HEADS_FIRST if heads_first is None else heads_first
    if qk_norm is not None:
        heads = 0
    elif launch and len(launch) > 3:
        heads = launch[3]
    else:
        heads = packed_heads(bsz, hkv, num_splits, quant, q.device)
    if launch and len(launch) > 4:
        maxnreg = launch[4]
    elif quant and num_splits == 1:
        maxnreg = packed_maxnreg(heads) if heads else _FP8_MAXNREG
    else:
        maxnreg = 0
    options: dict[str, int] = dict(pdl_launch(pdl))
    if maxnreg and q.is_cuda:  # (the interpreter takes no such option)
        options["maxnreg"] = maxnreg
    if heads:
        flags = dict(HAS_NEW=new_kv is not None, ROPE=rope is not None, QUANT=quant, KV_F16=_kv_f16(quant, q),
                     V_T=v_t, IEEE=ieee, PDL=pdl)  # fmt: skip
        decode_packed(q, k_cache, v_cache, page_table, seq_lens, k_new, v_new, slots, cos, sin, (k_scale, v_scale),
                      out, partial, lse, done, sm_scale, page_size, num_splits, heads, flags, launch, first,
                      options)  # fmt: skip
        return out
    block_s = triton.next_power_of_2(num_splits)
    block_g = min(triton.next_power_of_2(group), max(1, 8192 // (block_s * block_d)))  # <= 64 floats a thread
    _decode_kernel[(hkv, bsz, num_splits) if first else (bsz, hkv, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, k_new, v_new, slots, cos, sin, qw, kw, k_scale, v_scale, out,
        partial, lse, done,
        q.stride(0), q.stride(1), k_new.stride(0), v_new.stride(0), k_cache.stride(0), k_cache.stride(1),
        page_table.stride(0), cos.stride(0), v_cache.stride(0), sm_scale, eps,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=d, BLOCK_D=block_d,
        BLOCK_HALF=max(16, triton.next_power_of_2(d // 2)), PS=page_size, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, HAS_NEW=new_kv is not None, ROPE=rope is not None, QK_NORM=qk_norm is not None,
        QUANT=quant, KV_F16=_kv_f16(quant, q), V_T=v_t, IEEE=ieee, PDL=pdl,
        PEEL=new_kv is not None and num_splits > 1 and _PREWAIT, BLOCK_G=block_g, BLOCK_S=block_s,
        HEADS_FIRST=first, LAZY=_LAZY, V_PAGES=v_pages, num_warps=warps, num_stages=stages, **options,
    )  # fmt: skip
    return out


@triton.jit
def _extend_kernel(
    Q,  # (T, HQ, D)
    KCache,  # (S, HKV, D)
    VCache,
    Out,  # (T, HQ, D)
    PageTable,  # (B, stride_pt) int32
    QStarts,  # (B + 1,) int32: request b's new tokens are rows [QStarts[b], QStarts[b + 1])
    SeqLens,  # (B,) int32: cached + new tokens
    KScale,  # QUANT: (HKV,) float32, the fp8 cache's scales
    VScale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cs,
    stride_ch,
    stride_pt,
    stride_vp,  # V_T: V's stride between pages
    sm_scale,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,
    KV_F16: tl.constexpr,
    V_T: tl.constexpr,
    IEEE: tl.constexpr,
):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(QStarts + b)
    ext = tl.load(QStarts + b + 1) - q_start
    seq_len = tl.load(SeqLens + b)
    prefix = seq_len - ext
    kvh = h // GROUP
    wide: tl.constexpr = QUANT and not KV_F16 and Q.dtype.element_ty == tl.bfloat16  # as in decode
    if QUANT:
        qk_scale = sm_scale * tl.load(KScale + kvh) * (WIDEN if wide else 1.0)
        v_scale = tl.load(VScale + kvh) * (WIDEN if wide else 1.0)
    else:
        qk_scale = sm_scale
        v_scale = 1.0

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < ext
    q_pos = prefix + offs_m  # (BLOCK_M,) positions of these queries in the sequence
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    if KV_F16:
        q = q.to(tl.float16)
    # Keys up to the block's last query (causal); nothing for a block past this request's tokens.
    kv_end = tl.where(mb * BLOCK_M < ext, tl.minimum(seq_len, prefix + (mb + 1) * BLOCK_M), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pt_row = PageTable + b.to(tl.int64) * stride_pt
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < kv_end
        page_mask = (pos // PS) * PS < kv_end  # as in the decode kernel
        page = tl.load(pt_row + pos // PS, mask=page_mask, other=0).to(tl.int64)
        slot = page * PS + pos % PS
        kv_off = slot[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = _widen(tl.load(KCache + kv_off, mask=kv_mask, other=0.0), q.dtype, wide)  # (BLOCK_N, BLOCK_D)
        s = _dot(q, tl.trans(k), IEEE) * qk_scale  # (BLOCK_M, BLOCK_N)
        allowed = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at zero
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _widen(_v_block(VCache, pt_row, n0, kv_end, pos, n_mask, page_mask, page, kvh, offs_d, d_mask, stride_cs,
                            stride_ch, stride_vp, D, BLOCK_D, PS, BLOCK_N, V_T, False), q.dtype, wide)  # fmt: skip
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    tl.store(
        Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    max_extend: int,
    page_size: int,
    sm_scale: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    launch: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """q (T, Hq, D) of every request's new tokens (rows q_starts[b]..q_starts[b+1]); their K/V
    already stored in the pool; page_table (B, P) int32; seq_lens (B,) int32 -> (T, Hq, D), causal.
    scales: an fp8 cache's (k_scale, v_scale), each (Hkv,) float32. launch: (BLOCK_M, BLOCK_N, warps,
    stages) instead of `extend_launch`'s (benchmarks)."""
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    if hq % hkv or k_cache.shape[2] != d or q.stride(2) != 1 or page_table.stride(1) != 1:
        raise ValueError(f"extend_attention: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    out = q.new_empty(t, hq, d)
    bsz = seq_lens.shape[0]
    if t == 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))
    k_scale, v_scale, quant = _scale_args(k_cache, scales)
    block_m, block_n, warps, stages = launch or extend_launch(block_d, q.dtype, quant)
    grid = (triton.cdiv(max_extend, block_m), hq, bsz)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, q_starts, seq_lens, k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        page_table.stride(0), v_cache.stride(0), sm_scale,
        GROUP=hq // hkv, D=d, BLOCK_D=block_d, PS=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        QUANT=quant, KV_F16=_kv_f16(quant, q), V_T=_v_layout(k_cache, v_cache, page_size)[0],
        IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def extend_launch(block_d: int, dtype: torch.dtype, quant: bool = False) -> tuple[int, int, int, int]:
    """The extend kernel's (BLOCK_M, BLOCK_N, warps, stages) for a head size padded to block_d and q's
    dtype, over an fp8 pool (quant) or not. On an H200, a 4,096-token chunk of the throughput workload
    at 8B's heads (`benchmarks/bench_extend_attention.py`): a bf16 pool 154.8 us with (64, 32, 4, 2),
    162.4 with (64, 64, 4, 2); an fp8 pool 150.1 us with (64, 64, 4, 2), 205.6 with (64, 32, 4, 2)."""
    if dtype == torch.float32:
        return 32, 32, 4, 2  # full-precision dots need more registers
    if quant and block_d <= 128:
        return 64, 64, 4, 2
    return (64 if block_d <= 128 else 32), (64 if block_d <= 64 else 32), 4, 2

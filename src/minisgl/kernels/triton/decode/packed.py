"""Decode attention with HEADS KV heads a program: their query rows stacked into one tensor-core tile.

`attention._decode_kernel` gives a KV head's GROUP query heads (4 for Llama-3.1-8B) a 16-row tile:
three quarters of every score, exp and rescale it computes are padding, and each program pays the
page-table lookups, q's load and RoPE and the new token's work for one head's 256 bytes a token (an
fp8 pool). Here a program takes HEADS neighbouring KV heads (4 x 4 = 16 rows at 8B's shapes): q is
(BLOCK_M, D), row r the query head kvh0 * GROUP + r of KV head g(r) = kvh0 + r // GROUP. Each block of
positions takes one dot per KV head g, every row against g's keys, of which the rows of head g are
kept (the tensor-core work per token is the one-head kernel's: there the rows are padding, here the
other heads' rows); one online softmax over the 16 rows; then P @ V as one dot per head g with the
rows of the other heads zeroed, all summed into one (BLOCK_M, D) accumulator (the rows do not
overlap, so each row gets its own head's values). q and the accumulator are as small as the one-head
kernel's (a first version stacked the heads' channels side by side, block-diagonal: q (16, 4 x 128)
as a dot operand that every warp holds whole took 148-234 registers a thread).

Numerics are those of the one-head kernel: the same dtypes for the dots (fp16 for an fp8 pool with
16-bit q, or `widen_fp8`'s bf16), the scales folded into the scores and the output, the new token
stored rounded and attended as stored. Splits write the same partial outputs and log-sum-exps and
the last program of a (request, head group) merges them. No loads before PDL's wait (the one-head
kernel keeps that for batch 1)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..fp8 import WIDEN, quantize_fp8, widen_fp8
from ..kv_pages import v_at as _v_at
from ..pdl import pdl_enter

# MINISGL_FP8_ATTN_V2: 1 (default) this kernel for an fp8 pool at one split from
# MINISGL_FP8_ATTN_V2_MIN_BATCH (160) requests (`packed_heads`); "all" at every split count and batch
# too; 0 the one-head kernel always. On an H200 at 8B's shapes, contexts spread and longest first
# (`bench_decode_attention.py --context-range`), 2 heads a program (64, 4, 2, maxnreg 128) against the
# one-head kernel: batch 256 128.1 / 136.9 us (context 1024: 196.4 / 210.4), 224 127.5 / 138.4, 192
# 117.2 / 124.2, but 128 117.1 / 90.1 and 96 100.1 / 71.6 (too few programs a multiprocessor); 4 heads
# (32, 4, 2, maxnreg 96) 222.1 us at batch 256, context 1024. In the throughput workload, from 160
# requests decode took 8.82 ms a step, from 224 8.89, never 8.95 (docs/benchmarks.md, "fp8 weights and KV
# cache"). MINISGL_FP8_ATTN_HEADS: KV heads a program at most (default 2).
# MINISGL_FP8_ATTN_PER_SM: the programs a multiprocessor that `packed_heads` keeps at least (default 2).
# MINISGL_FP8_ATTN_V2_MAXNREG: the registers a thread at most (default by heads, `packed_maxnreg`).
_MODE = os.environ.get("MINISGL_FP8_ATTN_V2", "1")
_MAX_HEADS = int(os.environ.get("MINISGL_FP8_ATTN_HEADS", "2"))
_PER_SM = float(os.environ.get("MINISGL_FP8_ATTN_PER_SM", "2"))
_MIN_BATCH = int(os.environ.get("MINISGL_FP8_ATTN_V2_MIN_BATCH", "160"))
_MAXNREG = int(os.environ.get("MINISGL_FP8_ATTN_V2_MAXNREG", "0"))


def packed_maxnreg(heads: int) -> int:
    """ptxas' register cap for `heads` KV heads a program: 128 for 2 (its measured best), 96 for more
    (80 spills inside the loop); MINISGL_FP8_ATTN_V2_MAXNREG overrides."""
    return _MAXNREG or (128 if heads <= 2 else 96)


def packed_launch(heads: int) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages) for `heads` KV heads a program: a 64-position block for 2 heads (32 for
    more: the (16, 64) scores and the (64, D) K and V tiles of each head live at once)."""
    return (64, 4, 2) if heads <= 2 else (32, 4, 2)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def packed_heads(bsz: int, hkv: int, num_splits: int, quant: bool, device: torch.device) -> int:
    """KV heads a program for `decode_packed`, or 0 for the one-head kernel: an fp8 pool at one split
    and at least MINISGL_FP8_ATTN_V2_MIN_BATCH (160) requests (MINISGL_FP8_ATTN_V2=all: any split count
    and batch), the most heads (a power of two up to MINISGL_FP8_ATTN_HEADS) that still leave
    MINISGL_FP8_ATTN_PER_SM (2) programs a multiprocessor, and at least 2 heads (one is the one-head
    kernel's case)."""
    if _MODE == "0" or not quant or hkv < 2:
        return 0
    if _MODE != "all" and (num_splits > 1 or bsz < _MIN_BATCH):
        return 0
    want = _PER_SM * _num_sms(device)
    heads = min(triton.next_power_of_2(hkv), max(1, _MAX_HEADS))
    while heads >= 2 and bsz * triton.cdiv(hkv, heads) * num_splits < want:
        heads //= 2
    return heads if heads >= 2 else 0


@triton.jit
def _widen(x, dtype: tl.constexpr, WIDE: tl.constexpr):
    if WIDE:  # fp8 -> bf16 times 2^-112 (`fp8.widen_fp8`)
        return widen_fp8(x)
    return x.to(dtype)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _rope_cols(x, xp, cos_c, sin_c):
    """Rotate-half on whole rows: x at channel d, xp at its partner (d +- D/2), sin_c already negated
    in the first half; in float32, rounded back to x's dtype once (as `attention._rotate`)."""
    return (x.to(tl.float32) * cos_c + xp.to(tl.float32) * sin_c).to(x.dtype)


@triton.jit
def _decode_packed_kernel(
    Q, KCache, VCache, PageTable, SeqLens, KNew, VNew, NewSlots, Cos, Sin, KScale, VScale, Out, Partial,
    Lse, Done,
    stride_qb, stride_qh, stride_kn, stride_vn, stride_cs, stride_ch, stride_pt, stride_rope, stride_vp,
    sm_scale,
    HKV: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, PS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_NEW: tl.constexpr, ROPE: tl.constexpr, QUANT: tl.constexpr, KV_F16: tl.constexpr, V_T: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr, BLOCK_S: tl.constexpr, HEADS_FIRST: tl.constexpr,
):  # fmt: skip
    """The arguments of `attention._decode_kernel`; a program per (request, group of HEADS KV heads,
    split)."""
    if HEADS_FIRST:
        grp = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        grp = tl.program_id(1)
    split = tl.program_id(2)
    pdl_enter(PDL)
    kvh0 = grp * HEADS
    seq_len = tl.load(SeqLens + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    cached_end = tl.minimum(end, seq_len - 1) if HAS_NEW else end  # the newest position: from the inputs
    HALF: tl.constexpr = D // 2
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_m = tl.arange(0, BLOCK_M)  # rows: query heads kvh0 * GROUP + r, of KV head head_m
    head_m = kvh0 + offs_m // GROUP
    m_mask = (offs_m < HEADS * GROUP) & (head_m < HKV)
    md_mask = m_mask[:, None] & d_mask[None, :]
    wide: tl.constexpr = QUANT and not KV_F16 and Q.dtype.element_ty == tl.bfloat16
    unit = WIDEN if wide else 1.0
    if QUANT:
        ks_m = tl.load(KScale + head_m, mask=m_mask, other=1.0)
        vs_m = tl.load(VScale + head_m, mask=m_mask, other=1.0)
    else:
        ks_m = tl.full([BLOCK_M], 1.0, tl.float32)
        vs_m = tl.full([BLOCK_M], 1.0, tl.float32)
    qk_scale_m = sm_scale * ks_m  # (BLOCK_M,)
    d_p = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)  # RoPE's partner channel
    if ROPE:  # sin negated where the partner is subtracted
        rope_off = b.to(tl.int64) * stride_rope + offs_d % HALF
        cos_d = tl.load(Cos + rope_off, mask=d_mask, other=1.0).to(tl.float32)
        sin_d = tl.load(Sin + rope_off, mask=d_mask, other=0.0).to(tl.float32)
        sin_d = tl.where(offs_d < HALF, -sin_d, sin_d)[None, :]
        cos_d = cos_d[None, :]

    q_row = Q + b.to(tl.int64) * stride_qb + (kvh0 * GROUP + offs_m)[:, None] * stride_qh
    q = tl.load(q_row + offs_d[None, :], mask=md_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    if ROPE:
        q = _rope_cols(q, tl.load(q_row + d_p[None, :], mask=md_mask, other=0.0), cos_d, sin_d)
    if KV_F16:
        q = q.to(tl.float16)

    if HAS_NEW:  # each row holds its KV head's new K and V
        kn_row = KNew + b.to(tl.int64) * stride_kn + head_m[:, None] * D
        kn = tl.load(kn_row + offs_d[None, :], mask=md_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
        if ROPE:
            kn = _rope_cols(kn, tl.load(kn_row + d_p[None, :], mask=md_mask, other=0.0), cos_d, sin_d)
        vn = tl.load(VNew + b.to(tl.int64) * stride_vn + head_m[:, None] * D + offs_d[None, :], mask=md_mask,
                     other=0.0)  # fmt: skip
        if QUANT:  # as the pool will hold them
            kn = quantize_fp8(kn, ks_m[:, None])
            vn = quantize_fp8(vn, vs_m[:, None])
        if split == 0:  # these heads' new K/V into the pool, from each head's first row
            new_slot = tl.load(NewSlots + b).to(tl.int64)
            w_mask = (
                md_mask & (offs_m % GROUP == 0)[:, None] & (offs_d < tl.where(new_slot >= 0, D, 0))[None, :]
            )
            tl.store(
                KCache + new_slot * stride_cs + head_m[:, None] * stride_ch + offs_d[None, :], kn, mask=w_mask
            )
            v_dst = _v_at(VCache, new_slot // PS, new_slot % PS, head_m[:, None], offs_d[None, :], stride_cs,
                          stride_ch, stride_vp, D, PS, V_T)  # fmt: skip
            tl.store(v_dst, vn, mask=w_mask)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    s_scale = qk_scale_m * unit
    pt_row = PageTable + b.to(tl.int64) * stride_pt
    for n0 in range(start, cached_end, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)  # start is: so a page's positions are known contiguous
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < cached_end
        page_mask = (pos // PS) * PS < cached_end  # V by page: whole pages (see `attention._k_block`)
        page = tl.load(pt_row + pos // PS, mask=page_mask, other=0).to(tl.int64)
        k_off = ((page * PS + pos % PS) * stride_cs)[:, None] + offs_d[None, :]  # (BLOCK_N, BLOCK_D)
        s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for g in tl.static_range(HEADS):  # every row against head g's keys, kept in head g's rows
            k_mask = n_mask[:, None] & (offs_d < tl.where(kvh0 + g < HKV, D, 0))[None, :]  # past Hkv: nothing
            k = _widen(
                tl.load(KCache + k_off + (kvh0 + g) * stride_ch, mask=k_mask, other=0.0), q.dtype, wide
            )
            s = tl.where((head_m == kvh0 + g)[:, None], _dot(q, tl.trans(k), IEEE), s)
        s = tl.where(n_mask[None, :], s * s_scale[:, None], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v_rows = page_mask if V_T else n_mask
        for g in tl.static_range(HEADS):  # head g's rows of p times its values: the rows do not overlap
            v_ptr = _v_at(VCache, page[:, None], (pos % PS)[:, None], kvh0 + g, offs_d[None, :], stride_cs,
                          stride_ch, stride_vp, D, PS, V_T)  # fmt: skip
            v_mask = v_rows[:, None] & (offs_d < tl.where(kvh0 + g < HKV, D, 0))[None, :]
            v = _widen(tl.load(v_ptr, mask=v_mask, other=0.0), q.dtype, wide)
            p_g = tl.where((head_m == kvh0 + g)[:, None], p, 0.0).to(v.dtype)
            acc += _dot(p_g, v, IEEE)  # in `unit`s
        m_i = m_new
    if HAS_NEW:
        if (start <= seq_len - 1) & (seq_len - 1 < end):
            s_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32), 1) * qk_scale_m
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp(m_i - m_new)
            p_new = tl.exp(s_new - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * (vn.to(tl.float32) * (1.0 / unit))
            m_i = m_new

    has = end > start
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = tl.where(has, acc * (vs_m * unit / safe_l)[:, None], 0.0)
    row = b.to(tl.int64) * (GROUP * HKV) + kvh0 * GROUP + offs_m  # (BLOCK_M,) flat (b, query head)
    if NUM_SPLITS == 1:
        tl.store(Out + row[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty), mask=md_mask)
    else:
        lse = tl.where(has, m_i + tl.log(safe_l), float("-inf"))
        tl.store(Partial + (row[:, None] * NUM_SPLITS + split) * D + offs_d[None, :], out, mask=md_mask)
        tl.store(Lse + row * NUM_SPLITS + split, lse, mask=m_mask)
        tl.debug_barrier()  # as in `attention._decode_kernel`: stores before the release
        counter = Done + b * HKV + kvh0
        if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
            tl.store(counter, 0)  # ready for the next launch
            _merge(Partial, Lse, Out, row, m_mask, NUM_SPLITS, D, BLOCK_M, BLOCK_S, BLOCK_D)


@triton.jit
def _merge(Partial, Lse, Out, row, m_mask, NUM_SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Out of the rows `row` (where m_mask) = their splits' outputs weighted by exp(log-sum-exp)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    ms_mask = m_mask[:, None] & (offs_s < NUM_SPLITS)[None, :]
    lse = tl.load(
        Lse + row[:, None] * NUM_SPLITS + offs_s[None, :],
        mask=ms_mask,
        other=float("-inf"),
        cache_modifier=".cg",
    )  # fmt: skip  (BLOCK_M, BLOCK_S)
    m = tl.max(lse, 1)
    w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m)[:, None])  # no split with keys: weights 0
    den = tl.where(tl.sum(w, 1) > 0, tl.sum(w, 1), 1.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in tl.static_range(NUM_SPLITS):  # one split's rows at a time: (BLOCK_M, BLOCK_D) floats
        part = tl.load(Partial + (row[:, None] * NUM_SPLITS + s) * D + offs_d[None, :],
                       mask=m_mask[:, None] & (offs_d < D)[None, :], other=0.0, cache_modifier=".cg")  # fmt: skip
        acc += tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), 1)[:, None] * part
    mask = m_mask[:, None] & (offs_d < D)[None, :]
    tl.store(
        Out + row[:, None] * D + offs_d[None, :], (acc / den[:, None]).to(Out.dtype.element_ty), mask=mask
    )


def decode_packed(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor,
    partial: torch.Tensor, lse: torch.Tensor, done: torch.Tensor, sm_scale: float, page_size: int,
    num_splits: int, heads: int, flags: dict[str, bool], launch: tuple[int, ...] | None, heads_first: bool,
    options: dict[str, int],
) -> None:  # fmt: skip
    """Launch `_decode_packed_kernel` over `attention.decode_attention`'s checked arguments (flags: its
    HAS_NEW, ROPE, QUANT, KV_F16, V_T, IEEE and PDL; options: the launch's PDL and maxnreg)."""
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    block_d = max(16, triton.next_power_of_2(d))
    block_n, warps, stages = (launch or ())[:3] or packed_launch(heads)
    grid_h = triton.cdiv(hkv, heads)
    _decode_packed_kernel[(grid_h, bsz, num_splits) if heads_first else (bsz, grid_h, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, k_new, v_new, slots, cos, sin, scales[0], scales[1], out,
        partial, lse, done,
        q.stride(0), q.stride(1), k_new.stride(0), v_new.stride(0), k_cache.stride(0), k_cache.stride(1),
        page_table.stride(0), cos.stride(0), v_cache.stride(0), sm_scale,
        HKV=hkv, GROUP=group, HEADS=heads, BLOCK_M=max(16, triton.next_power_of_2(heads * group)), D=d,
        BLOCK_D=block_d, PS=page_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), HEADS_FIRST=heads_first, num_warps=warps,
        num_stages=stages, **flags, **options,
    )  # fmt: skip

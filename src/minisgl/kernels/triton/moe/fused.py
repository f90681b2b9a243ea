"""The routed experts of a mixture-of-experts layer in three Triton launches, all on the device:

1. `_align_kernel` (one program): the token-expert pairs (pair p = token * K + slot) counted per
   expert, each expert's count padded to a multiple of BLOCK_M, the pairs scattered into their
   expert's padded range (`sorted_ids`, padding holds P) and each block of BLOCK_M rows told its
   expert (`block_expert`); `total` is the padded length. Within an expert the pairs land in any
   order (atomics): rows of a tile never mix, so the results do not depend on it. For a decode
   batch (`ROUTE_IN_ALIGN` tokens at most) the same program routes first: softmax and top-k of each
   token's router logits (`moe.route`), so routing and alignment are one launch. From the router's
   weight instead of its logits (`route_and_align`, what the CUDA backend calls at decode sizes),
   `_router_kernel` computes the logits too: its programs split the experts and H, and the last one
   to finish sums the slices, routes and aligns, so the router is one launch where it was two.
2. `_gate_up_kernel`: one grouped GEMM over the blocks, gate and up columns of the same expert
   together, SiLU(gate) x up as its epilogue -> act (P, I), row = pair.
3. `_down_kernel`: the second grouped GEMM, act @ w2[e]^T, each row scaled by its routing weight
   (divided by the token's sum of weights when renormalizing) -> (P, H) partial rows; then each
   token's K rows are summed (and added to the residual) by whichever program finishes that
   token's columns last: a counter per (token, column block), so no k-sum kernel follows, and the
   sum runs in slot order whatever the schedule (deterministic, the same at every batch size).
Grids are sized for the worst case (P + min(P, E) (BLOCK_M - 1) padded rows) and programs past
`total` return at once, so nothing waits on the host: the launches run inside CUDA graphs. On
Hopper they launch with programmatic dependent launch (`pdl`), as the decode step's other kernels.

A program per pair instead of 16-row tiles at decode sizes (no sort) was tried and was slower than
the grouped GEMMs at every size measured (docs/benchmarks.md, "Mixtures of experts"), so from two
tokens on every size takes the grouped GEMMs. One token (batch-1 decode, `routed_moe_from_router`)
can take two row GEMVs on the CUDA cores instead (`moe.experts`: no padding to 16-row tiles, the k-sum
in the down kernel's registers), routed inside gate/up's programs from the router's partial logits:
MINISGL_MOE_B1=1 (opt-in; on an H200 they lost to the grouped GEMMs, 3.46 against 3.09 ms a step),
MINISGL_MOE_B1_ROUTE=0 to route them in the router's last program instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..counters import zeroed_counters
from ..pdl import pdl_enter, pdl_launch, use_pdl
from . import experts
from .route import route_topk, topk_rows, topk_tile


@dataclass(frozen=True)
class MoeConfig:
    """Launch shape of the two GEMMs: BLOCK_M pair rows, BLOCK_N output columns, BLOCK_K per step."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def moe_config(pairs: int, dtype: torch.dtype) -> MoeConfig:
    """A launch shape by the number of token-expert pairs: a 16-row tile while the experts see a few
    tokens each (decode), 64 rows when they see many (prefill)."""
    if pairs <= 256:
        cfg = MoeConfig(16, 64, 128, 4, 3)
    else:
        cfg = MoeConfig(64, 128, 64, 8, 3)
    return _float32(cfg) if dtype == torch.float32 else cfg


def down_config(pairs: int, dtype: torch.dtype) -> MoeConfig:
    """The down GEMM's launch shape (block_m as `moe_config`'s)."""
    return moe_config(pairs, dtype)


def _float32(cfg: MoeConfig) -> MoeConfig:
    """float32 (the tests) takes shorter K steps: its tiles are twice as large."""
    return MoeConfig(cfg.block_m, min(cfg.block_n, 64), 32, cfg.num_warps, 2)


@triton.jit
def _dot_t(a, w, IEEE: tl.constexpr):
    """a (M, K) @ w (N, K)^T in float32; IEEE: full-precision float32 dots (the tests' dtype)."""
    if IEEE:
        out = tl.dot(a, tl.trans(w), input_precision="ieee")
    else:
        out = tl.dot(a, tl.trans(w))
    return out


@triton.jit
def _align(
    Ids,  # (P,) each pair's expert
    SortedIds,  # (max_padded,) out: pairs grouped by expert, P in the padding
    BlockExpert,  # (max_blocks,) out: the expert of each block of BLOCK_M rows
    Total,  # (1,) out: the padded length actually used
    Cursor,  # (E_PAD,) scratch: each expert's next free row
    p,
    num_experts,
    max_padded,
    max_blocks,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCKS_CHUNK: tl.constexpr,
):
    """One program sorts and pads the pairs (the module's step 1)."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, p, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        e = tl.load(Ids + offs, mask=offs < p, other=E_PAD - 1).to(tl.int32)  # padding: the spare bin
        counts += tl.histogram(e, E_PAD)
    counts = tl.where(experts < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # (E_PAD,) each expert's padded range ends here
    tl.store(Cursor + experts, ends - padded)
    tl.store(Total, tl.sum(padded, 0))
    for r0 in range(0, max_padded, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        tl.store(SortedIds + rows, tl.zeros([CHUNK], tl.int32) + p, mask=rows < max_padded)
    for b0 in range(0, max_blocks, BLOCKS_CHUNK):  # (BLOCKS_CHUNK, E_PAD) compares at a time
        blocks = b0 + tl.arange(0, BLOCKS_CHUNK)
        # a block's expert: how many experts' ranges end at or before its first row
        done = (ends[None, :] <= blocks[:, None] * BLOCK_M) & (experts[None, :] < num_experts)
        tl.store(BlockExpert + blocks, tl.sum(done.to(tl.int32), 1), mask=blocks < max_blocks)
    tl.debug_barrier()  # the cursors and the padding are written before the scatter below
    for c0 in range(0, p, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        mask = offs < p
        e = tl.load(Ids + offs, mask=mask, other=0).to(tl.int32)
        row = tl.atomic_add(Cursor + e, 1, mask=mask)
        tl.store(SortedIds + row, offs, mask=mask)


@triton.jit
def _align_one_token(
    chosen_e,  # (BLOCK_T, K_PAD) int64: row 0 holds the one token's K distinct experts
    SortedIds,
    BlockExpert,
    Total,
    max_padded,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """`_align` for one token whose K experts are distinct (a top-k's): each expert has one pair, so
    pair j takes block j's first row and the rest is padding. `_align` orders the same blocks by
    expert; rows of a tile are computed apart, so every row's result is the same bits either way."""
    for r0 in range(0, max_padded, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        pair = tl.where((r % BLOCK_M == 0) & (r < TOP_K * BLOCK_M), r // BLOCK_M, TOP_K)  # P = TOP_K
        tl.store(SortedIds + r, pair, mask=r < max_padded)
    slots = tl.arange(0, K_PAD)
    first = tl.sum(tl.where((tl.arange(0, chosen_e.shape[0]) == 0)[:, None], chosen_e, 0), 0)  # (K_PAD,)
    tl.store(BlockExpert + slots, first.to(tl.int32), mask=slots < TOP_K)
    tl.store(Total, TOP_K * BLOCK_M)


@triton.jit
def _align_kernel(
    Ids,  # (P,) each pair's expert (written here first when ROUTE)
    SortedIds,
    BlockExpert,
    Total,
    Cursor,
    Logits,  # ROUTE: (T, E) router logits, else unused
    Weights,  # ROUTE: (P,) float32 out, else unused
    p,
    num_experts,
    max_padded,
    max_blocks,
    stride_l,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCKS_CHUNK: tl.constexpr,
    ROUTE: tl.constexpr,
    ROUTE_T: tl.constexpr,  # ROUTE: the tokens, rounded up to a power of two
    E_ROUTE: tl.constexpr,  # ROUTE: the experts, rounded up to a power of two
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    if ROUTE:  # the tokens' top-k first, all at once (a decode batch: ROUTE_IN_ALIGN tokens at most)
        topk_rows(
            Logits,
            Weights,
            Ids,
            0,
            p // TOP_K,
            num_experts,
            stride_l,
            ROUTE_T,
            TOP_K,
            K_PAD,
            E_ROUTE,
            RENORMALIZE,
        )
        tl.debug_barrier()  # the ids are written before they are counted
    _align(
        Ids, SortedIds, BlockExpert, Total, Cursor, p, num_experts, max_padded, max_blocks,
        E_PAD, BLOCK_M, CHUNK, BLOCKS_CHUNK,
    )  # fmt: skip


@triton.jit
def _router_kernel(
    X,  # (T, H), unit stride in H: the residual stream when NORM, else the router's input
    Router,  # (E, H), unit stride in H
    NormW,  # NORM: (H,) the RMSNorm's weight, else unused
    XN,  # NORM: (T, H) contiguous out: rmsnorm(X) * NormW, the experts' input, else unused
    Partial,  # (splits, BLOCK_T, E_ROUTE) float32 scratch: each split's partial logits
    Counter,  # (1,) int32, zero, left zero: programs done
    Ids,  # (P,) int64 out: each pair's expert
    Weights,  # (P,) float32 out: its routing weight
    SortedIds,
    BlockExpert,
    Total,
    Cursor,
    t,
    num_experts,
    h,
    stride_xm,
    stride_rn,
    k_split,  # columns of H per split (a multiple of BLOCK_K)
    max_padded,
    max_blocks,
    eps,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_ROUTE: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCKS_CHUNK: tl.constexpr,
    IEEE: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # NORM: H rounded up to a power of two
    ONE_TOKEN: tl.constexpr,
    TAIL: tl.constexpr,  # False: only the partial logits (and XN); the experts' kernel routes from them
    PDL: tl.constexpr,
):
    """A decode batch's router in one launch: program (i, s) computes experts i * BLOCK_E.. over the
    s-th slice of H; the last program to finish sums the slices in order, rounds the logits to x's
    dtype (as the projection does), routes (`topk_tile`) and aligns the pairs (`_align`; one token,
    ONE_TOKEN: its K distinct experts a block each, no sort). NORM: X is the residual stream and each
    program first normalizes its rows (`_rmsnorm_kernel`'s arithmetic, bit for bit); the programs of
    the first block of experts write the normed slices they read to XN, the experts' input."""
    pid_e, pid_s = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    row_mask = rows < t
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    x_rows = X + rows[:, None].to(tl.int64) * stride_xm
    w_rows = Router + offs_e[:, None].to(tl.int64) * stride_rn
    pdl_enter(PDL)
    if NORM:  # each row's 1 / rms as the RMSNorm kernel computes it: one row's sum over BLOCK_H lanes
        rstd = tl.zeros([BLOCK_T], tl.float32)
        cols = tl.arange(0, BLOCK_H)
        for r in range(0, t):
            xr = tl.load(X + r * stride_xm + cols, mask=cols < h, other=0.0).to(tl.float32)
            rstd = tl.where(rows == r, tl.rsqrt(tl.sum(xr * xr, axis=0) / h + eps), rstd)
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for k0 in range(pid_s * k_split, tl.minimum(h, (pid_s + 1) * k_split), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < h
        x = tl.load(x_rows + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:  # rounded as the RMSNorm kernel rounds: the normed x, then its product with the weight
            nw = tl.load(NormW + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            y = (x.to(tl.float32) * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
            x = (nw[None, :] * y).to(X.dtype.element_ty)
            if pid_e == 0:
                xn_ptrs = XN + rows[:, None].to(tl.int64) * h + offs_k[None, :]
                tl.store(xn_ptrs, x, mask=row_mask[:, None] & k_mask[None, :])
        w = tl.load(w_rows + offs_k[None, :], mask=e_mask[:, None] & k_mask[None, :], other=0.0)
        acc += _dot_t(x, w, IEEE)
    part_rows = Partial + (pid_s * BLOCK_T + rows)[:, None] * E_ROUTE
    tl.store(part_rows + offs_e[None, :], acc)
    if not TAIL:
        return
    tl.debug_barrier()  # every thread's part is stored before the count moves (release below)
    done = tl.atomic_add(Counter, 1, sem="acq_rel")
    tl.debug_barrier()  # the other programs' parts are read after the count (acquire above)
    if done == tl.num_programs(0) * tl.num_programs(1) - 1:
        experts = tl.arange(0, E_ROUTE)
        logits = tl.zeros([BLOCK_T, E_ROUTE], tl.float32)
        for s in range(0, tl.num_programs(1)):  # slice order, whichever program is last
            ptrs = Partial + (s * BLOCK_T + rows)[:, None] * E_ROUTE + experts[None, :]
            logits += tl.load(ptrs, cache_modifier=".cg")
        logits = logits.to(X.dtype.element_ty).to(tl.float32)  # rounded as the projection rounds
        logits = tl.where(row_mask[:, None] & (experts < num_experts)[None, :], logits, -float("inf"))
        chosen_p, chosen_e = topk_tile(logits, TOP_K, K_PAD, E_ROUTE, RENORMALIZE)
        slots = tl.arange(0, K_PAD)
        out = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
        out_mask = row_mask[:, None] & (slots < TOP_K)[None, :]
        tl.store(Weights + out, chosen_p, mask=out_mask)
        tl.store(Ids + out, chosen_e, mask=out_mask)
        if ONE_TOKEN:  # pair j (slot j) alone in block j, at its first row: no counting, no scatter
            _align_one_token(
                chosen_e, SortedIds, BlockExpert, Total, max_padded, TOP_K, K_PAD, BLOCK_M, CHUNK
            )
        else:
            tl.debug_barrier()  # the ids are written before they are counted
            p = t * TOP_K
            _align(
                Ids, SortedIds, BlockExpert, Total, Cursor, p, num_experts, max_padded, max_blocks,
                E_PAD, BLOCK_M, CHUNK, BLOCKS_CHUNK,
            )  # fmt: skip
        tl.atomic_xchg(Counter, 0)  # left at zero for the next call


@triton.jit
def _gate_up_kernel(
    X,  # (T, H)
    W13,  # (E, 2I, H): rows [gate | up] of each expert
    Act,  # (P, I) out, row = pair
    SortedIds,
    BlockExpert,
    Total,
    p,
    top_k,
    n,  # I
    k,  # H
    stride_xm,
    stride_we,
    stride_wn,
    stride_am,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(Total):
        return
    pairs = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    valid = pairs < p
    tokens = pairs // top_k
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    x_rows = X + tokens[:, None].to(tl.int64) * stride_xm  # (BLOCK_M, 1)
    g_rows = W13 + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
    u_rows = g_rows + n * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        x = tl.load(x_rows + offs_k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        wg = tl.load(g_rows + offs_k[None, :], mask=w_mask, other=0.0)
        wu = tl.load(u_rows + offs_k[None, :], mask=w_mask, other=0.0)
        acc_g += _dot_t(x, wg, IEEE)
        acc_u += _dot_t(x, wu, IEEE)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, rounded once
    a_ptrs = Act + pairs[:, None].to(tl.int64) * stride_am + offs_n[None, :]
    tl.store(a_ptrs, act.to(Act.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    Act,  # (P, I), row = pair
    W2,  # (E, H, I)
    Part,  # (P, H) out: each pair's scaled product, row = pair
    Out,  # (T, H) out: each token's sum over its K pairs (+ Res); may be Res
    Res,  # (T, H) the residual (ADD_RES), else unused
    Counters,  # (T, cdiv(H, BLOCK_N)) int32, zero, left zero: pairs of the token done per column block
    Weights,  # (P,) float32 routing weights
    SortedIds,
    BlockExpert,
    Total,
    p,
    n,  # H
    k,  # I
    stride_am,
    stride_we,
    stride_wn,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ADD_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    pdl_enter(PDL)
    if pid_m * BLOCK_M >= tl.load(Total):
        return
    pairs = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < p
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    n_mask = offs_n < n
    a_rows = Act + pairs[:, None].to(tl.int64) * stride_am
    w_rows = W2 + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        a = tl.load(a_rows + offs_k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += _dot_t(a, w, IEEE)
    weight = tl.load(Weights + pairs, mask=valid, other=0.0)  # (BLOCK_M,) float32
    tokens = pairs // TOP_K
    if RENORMALIZE:  # divided by the sum of the token's K weights, summed in slot order
        total = tl.zeros([BLOCK_M], tl.float32)
        for j in tl.static_range(TOP_K):
            total += tl.load(Weights + tokens * TOP_K + j, mask=valid, other=1.0)
        weight = weight / total
    y = acc.to(Part.dtype.element_ty).to(tl.float32) * weight[:, None]  # the product rounded, then scaled
    mask = valid[:, None] & n_mask[None, :]
    tl.store(Part + pairs[:, None].to(tl.int64) * n + offs_n[None, :], y.to(Part.dtype.element_ty), mask=mask)
    # The k-sum: each row of this tile counts once for its token (rows of one token in one tile, were
    # its experts not distinct, count apart); the program that brings a count to K sums its K rows.
    tl.debug_barrier()  # every thread's part is stored before the count moves (release below)
    counters = Counters + tokens.to(tl.int64) * tl.num_programs(1) + pid_n
    done = tl.atomic_add(counters, 1, mask=valid, sem="acq_rel")
    last = valid & (done == TOP_K - 1)
    tl.debug_barrier()  # the other programs' parts are read after the count (acquire above)
    sums = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    rows = tokens.to(tl.int64) * TOP_K
    for j in tl.static_range(TOP_K):  # slot order, whichever program sums
        part = tl.load(
            Part + (rows + j)[:, None] * n + offs_n[None, :],
            mask=last[:, None] & n_mask[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        sums += part.to(tl.float32)
    out = sums.to(Out.dtype.element_ty)
    o_offs = tokens[:, None].to(tl.int64) * n + offs_n[None, :]
    if ADD_RES:
        res = tl.load(Res + o_offs, mask=last[:, None] & n_mask[None, :], other=0.0)
        out = (res.to(tl.float32) + out.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + o_offs, out, mask=last[:, None] & n_mask[None, :])
    tl.atomic_xchg(counters, 0, mask=last)  # left at zero for the next call


ROUTE_IN_ALIGN = 16  # at most this many tokens are routed inside the alignment's one program


def _align_buffers(
    p: int, num_experts: int, block_m: int, dev: torch.device
) -> tuple[tuple[torch.Tensor, ...], dict[str, int]]:
    """The alignment's outputs and scratch (sorted_ids, block_expert, total, cursor), sized for the
    worst case, and its launch constants."""
    max_padded = p + min(p, num_experts) * (block_m - 1)
    max_blocks = triton.cdiv(max_padded, block_m)
    e_pad = triton.next_power_of_2(num_experts + 1)  # one spare bin for masked loads
    bufs = (
        torch.empty(max_padded, dtype=torch.int32, device=dev),
        torch.empty(max_blocks, dtype=torch.int32, device=dev),
        torch.empty(1, dtype=torch.int32, device=dev),
        torch.empty(e_pad, dtype=torch.int32, device=dev),
    )
    consts = dict(E_PAD=e_pad, BLOCK_M=block_m, CHUNK=256, BLOCKS_CHUNK=max(1, 4096 // e_pad))
    return bufs, consts


def align_pairs(
    ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    route: tuple[torch.Tensor, torch.Tensor, bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (P,) each pair's expert -> (sorted_ids (max_padded,) int32 with P as padding,
    block_expert (max_blocks,) int32, total (1,) int32), all computed on the device. route: (router
    logits (T, E), weights (P,) float32, renormalize): ids (int64) and weights are written first,
    the tokens' top-k (`moe.route`'s rule)."""
    p = ids.shape[0]
    bufs, consts = _align_buffers(p, num_experts, block_m, ids.device)
    logits, weights, renormalize = route if route is not None else (ids, ids, False)
    top_k = p // logits.shape[0] if route is not None else 1
    pdl = use_pdl(ids)
    _align_kernel[(1,)](
        ids, *bufs, logits, weights, p, num_experts, bufs[0].shape[0], bufs[1].shape[0], logits.stride(0),
        ROUTE=route is not None, ROUTE_T=triton.next_power_of_2(p // top_k) if route is not None else 1,
        E_ROUTE=triton.next_power_of_2(num_experts), TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)),
        RENORMALIZE=renormalize, PDL=pdl, num_warps=4, **consts, **pdl_launch(pdl),
    )  # fmt: skip
    return bufs[0], bufs[1], bufs[2]


def route_and_align(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    block_m: int,
    norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A decode batch's router in one launch (`_router_kernel`): x (T, H) with T <= ROUTE_IN_ALIGN,
    router (E, H) in x's dtype -> (weights (T, K) float32, ids (T, K) int64, the aligned pairs as
    `align_pairs` gives them). The logits are x @ router^T rounded to x's dtype (what `linear`
    gives), routed by `moe.route`'s rule. norm (weight (H,), eps, out (T, H) contiguous): x is the
    residual stream, the router reads rmsnorm(x) * weight (the RMSNorm kernel's bits), written to out."""
    weights, ids, aligned, _ = _router_launch(x, router, top_k, renormalize, block_m, norm, True)
    return weights, ids, aligned


def _router_launch(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    block_m: int,
    norm: tuple[torch.Tensor, float, torch.Tensor] | None,
    tail: bool,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """`route_and_align`, and the partial logits (splits, BLOCK_T, E_ROUTE) float32. Without the
    tail, only the partial logits (and the normed x) are written: weights, ids and the aligned pairs
    are left for the experts' kernel to fill (`moe.experts`, one token)."""
    t, h = x.shape
    e = router.shape[0]
    if not 0 < t <= ROUTE_IN_ALIGN or router.shape[1] != h or x.stride(1) != 1 or router.stride(1) != 1:
        raise ValueError(f"route_and_align: x {tuple(x.shape)}, router {tuple(router.shape)}")
    if norm is not None and (norm[0].shape != (h,) or norm[2].shape != (t, h) or not norm[2].is_contiguous()):
        raise ValueError(f"route_and_align: norm weight {tuple(norm[0].shape)}, out {tuple(norm[2].shape)}")
    dev, p = x.device, t * top_k
    bufs, consts = _align_buffers(p, e, block_m, dev)
    block_e, block_k = 16, 32 if x.dtype == torch.float32 else 256
    e_route = max(block_e, triton.next_power_of_2(e))
    per_split = triton.cdiv(h, _router_splits(e, block_e))
    k_split = triton.cdiv(per_split, block_k) * block_k  # columns per program, whole BLOCK_K steps
    splits = triton.cdiv(h, k_split)
    block_t = max(16, triton.next_power_of_2(t))
    partial = torch.empty(splits, block_t, e_route, dtype=torch.float32, device=dev)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=dev)
    pdl = use_pdl(x)
    norm_w, eps, xn = norm if norm is not None else (x, 0.0, x)
    _router_kernel[(triton.cdiv(e, block_e), splits)](
        x, router, norm_w, xn, partial, zeroed_counters(1, dev, "router"), ids, weights, *bufs, t, e, h,
        x.stride(0), router.stride(0), k_split, bufs[0].shape[0], bufs[1].shape[0], eps, BLOCK_T=block_t,
        BLOCK_E=block_e, BLOCK_K=block_k, E_ROUTE=e_route, TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)),
        RENORMALIZE=renormalize, IEEE=x.dtype == torch.float32, NORM=norm is not None,
        BLOCK_H=triton.next_power_of_2(h) if norm is not None else 1, ONE_TOKEN=t == 1 and top_k <= e,
        TAIL=tail, PDL=pdl, num_warps=4, **consts, **pdl_launch(pdl),
    )  # fmt: skip
    return weights, ids, (bufs[0], bufs[1], bufs[2]), partial


def _router_splits(e: int, block_e: int) -> int:
    """Slices of H per block of experts: about 32 programs in all (the router is half a MB at 128
    experts of 2,048: latency, not bandwidth, so enough programs to have it all in flight at once)."""
    return max(1, 32 // triton.cdiv(e, block_e))


def routed_moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_moe` from the router's logits (T, E): routed (`moe.route`'s rule) inside the alignment
    for up to ROUTE_IN_ALIGN tokens, by `route_topk` for more -> (the output, ids (T, K))."""
    t = x.shape[0]
    if t > ROUTE_IN_ALIGN or t == 0:
        weights, ids = route_topk(logits, top_k, renormalize)
        return fused_moe(x, w13, w2, weights, ids, False, residual=residual), ids
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    cfg = moe_config(t * top_k, x.dtype)
    aligned = align_pairs(ids.view(-1), w13.shape[0], cfg.block_m, (logits, weights.view(-1), renormalize))
    return fused_moe(x, w13, w2, weights, ids, False, cfg, residual, aligned), ids


def routed_moe_from_router(
    x: torch.Tensor,
    router: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    residual: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`routed_moe` for a decode batch (1 to ROUTE_IN_ALIGN tokens) from the router's weight (E, H)
    in x's dtype: the logits, the routing and the alignment in one launch (`route_and_align`), then
    the two grouped GEMMs -> (the output, ids (T, K)). norm (weight (H,), eps): x is the residual
    stream and the experts' input is its RMSNorm, computed in the router's launch. One token with
    MINISGL_MOE_B1=1 (default off): the experts as row GEMVs (`moe.experts`), routed inside gate/up's
    programs (MINISGL_MOE_B1_ROUTE, default on) or by the router's last program."""
    cfg = moe_config(x.shape[0] * top_k, x.dtype)
    normed = (
        None if norm is None else (norm[0], norm[1], torch.empty(x.shape, dtype=x.dtype, device=x.device))
    )
    x_in = x if normed is None else normed[2]
    if x.shape[0] == 1 and top_k <= router.shape[0] and experts.row_path_enabled():
        in_gate_up = experts.route_in_gate_up()
        weights, ids, _, partial = _router_launch(
            x, router, top_k, renormalize, cfg.block_m, normed, tail=not in_gate_up
        )
        route = experts.RouterPartials(partial, router.shape[0], renormalize) if in_gate_up else None
        return experts.experts_one_token(x_in, w13, w2, weights, ids, False, residual, route), ids
    weights, ids, aligned = route_and_align(x, router, top_k, renormalize, cfg.block_m, normed)
    return fused_moe(x_in, w13, w2, weights, ids, False, cfg, residual, aligned), ids


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    renormalize: bool,
    config: MoeConfig | None = None,
    residual: torch.Tensor | None = None,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    down: MoeConfig | None = None,
) -> torch.Tensor:
    """x (T, H), w13 (E, 2I, H) [gate | up] rows, w2 (E, H, I), each token's K experts ids (T, K)
    with float32 weights (T, K) (divided by their sum here when `renormalize`) -> (T, H) = sum over
    them of weight * w2[e] @ (silu(gate_e x) * up_e x). Unit stride along H and I. With `residual`
    (T, H) contiguous, the result is added into it in place and it is returned. aligned: the pairs
    already sorted (`align_pairs` with `config`'s block_m). down: the down GEMM's launch shape
    (block_m must be config's; default: `down_config`'s, or config itself where config is given)."""
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter, top_k = two_i // 2, ids.shape[1]
    if (
        w13.shape[2] != h
        or w2.shape != (e, h, inter)
        or ids.shape != (t, top_k)
        or weights.shape != ids.shape
    ):
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, ids {tuple(ids.shape)}"
        )
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe: x, w13 and w2 need unit stride in their last dimension")
    if residual is not None and (residual.shape != (t, h) or not residual.is_contiguous()):
        raise ValueError(f"fused_moe: residual {tuple(residual.shape)} for an output ({t}, {h})")
    p = t * top_k
    if p == 0:
        return x.new_zeros(t, h) if residual is None else residual
    cfg = config or moe_config(p, x.dtype)
    dcfg = down or (config if config is not None else down_config(p, x.dtype))
    if dcfg.block_m != cfg.block_m:
        raise ValueError(f"fused_moe: the down GEMM's block_m {dcfg.block_m} is not gate/up's {cfg.block_m}")
    sorted_ids, block_expert, total = aligned or align_pairs(ids.reshape(-1), e, cfg.block_m)
    ieee, pdl = x.dtype == torch.float32, use_pdl(x)
    blocks = block_expert.shape[0]
    act = x.new_empty(p, inter)
    _gate_up_kernel[(blocks, triton.cdiv(inter, cfg.block_n))](
        x, w13, act, sorted_ids, block_expert, total, p, top_k, inter, h,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=ieee, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )  # fmt: skip
    part = x.new_empty(p, h)
    out = x.new_empty(t, h) if residual is None else residual
    col_blocks = triton.cdiv(h, dcfg.block_n)
    _down_kernel[(blocks, col_blocks)](
        act, w2, part, out, out, zeroed_counters(t * col_blocks, x.device, "down"), weights.reshape(-1).float().contiguous(),
        sorted_ids, block_expert, total, p, h, inter, act.stride(0), w2.stride(0), w2.stride(1),
        TOP_K=top_k, RENORMALIZE=renormalize, ADD_RES=residual is not None,
        BLOCK_M=dcfg.block_m, BLOCK_N=dcfg.block_n, BLOCK_K=dcfg.block_k, IEEE=ieee, PDL=pdl,
        num_warps=dcfg.num_warps, num_stages=dcfg.num_stages, **pdl_launch(pdl),
    )  # fmt: skip
    return out

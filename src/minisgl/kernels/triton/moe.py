"""The routed experts of a mixture-of-experts layer in three Triton launches, all on the device:

1. `_align_kernel` (one program): the token-expert pairs (pair p = token * K + slot) counted per
   expert, each expert's count padded to a multiple of BLOCK_M, the pairs scattered into their
   expert's padded range (`sorted_ids`, padding holds P) and each block of BLOCK_M rows told its
   expert (`block_expert`); `total` is the padded length. Within an expert the pairs land in any
   order (atomics): rows of a tile never mix, so the results do not depend on it.
2. `_gate_up_kernel`: one grouped GEMM over the blocks, gate and up columns of the same expert
   together, SiLU(gate) x up as its epilogue -> act (P, I), row = pair.
3. `_down_kernel`: the second grouped GEMM, act @ w2[e]^T, each row scaled by its routing weight
   (divided by the token's sum of weights when renormalizing) in the epilogue -> (P, H).
The caller sums each token's K rows. Grids are sized for the worst case (P + min(P, E) (BLOCK_M - 1)
padded rows) and programs past `total` return at once, so nothing waits on the host: the launches
run inside CUDA graphs.

A decode batch of a few tokens, whose pairs mostly reach distinct experts, takes two launches
instead (`pair_path`): no sort, each program streams BLOCK_N rows of one pair's expert (x riding in
a 16-row tensor-core tile, as minisgl's GEMV does). `_pair_gate_up_kernel`: a program per (pair,
BLOCK_N columns of I), SiLU(gate) x up its epilogue. `_pair_down_kernel`: a program per (token,
BLOCK_N columns of H) walks the token's K pairs in one loop, scales each expert's rounded product
by its routing weight and sums them (and adds the residual), so no k-sum kernel follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


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
    tokens each (decode), 64 rows when they see many (prefill). float32 (the tests) takes shorter K
    steps: its tiles are twice as large."""
    if pairs <= 256:
        cfg = MoeConfig(16, 64, 128, 4, 3)
    else:
        cfg = MoeConfig(64, 128, 64, 8, 3)
    if dtype == torch.float32:
        cfg = MoeConfig(cfg.block_m, min(cfg.block_n, 64), 32, cfg.num_warps, 2)
    return cfg


@triton.jit
def _dot_t(a, w, IEEE: tl.constexpr):
    """a (M, K) @ w (N, K)^T in float32; IEEE: full-precision float32 dots (the tests' dtype)."""
    if IEEE:
        out = tl.dot(a, tl.trans(w), input_precision="ieee")
    else:
        out = tl.dot(a, tl.trans(w))
    return out


@triton.jit
def _align_kernel(
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
):
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
    Out,  # (P, H) out, row = pair
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
    stride_om,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(Total):
        return
    pairs = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < p
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
    if RENORMALIZE:  # divided by the sum of the token's K weights, summed in slot order
        first = pairs // TOP_K * TOP_K
        total = tl.zeros([BLOCK_M], tl.float32)
        for j in tl.static_range(TOP_K):
            total += tl.load(Weights + first + j, mask=valid, other=1.0)
        weight = weight / total
    y = acc.to(Out.dtype.element_ty).to(tl.float32) * weight[:, None]  # the product rounded, then scaled
    o_ptrs = Out + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, y.to(Out.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class PairConfig:
    """Launch shape of the decode path: BLOCK_N weight rows per program, BLOCK_K columns per step
    (over H in gate/up, over I in down)."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    down_block_n: int = 16
    down_block_k: int = 256


def pair_path(tokens: int, top_k: int, experts: int) -> bool:
    """Whether the decode path takes a batch: one token always (its K experts are distinct); more while
    their pairs are few beside the experts (T K <= E / 4), so that few experts are streamed twice."""
    return tokens == 1 or tokens * top_k * 4 <= experts


@triton.jit
def _pair_gate_up_kernel(
    X,  # (T, H)
    W13,  # (E, 2I, H): rows [gate | up] of each expert
    Act,  # (P, I) out, row = pair
    Ids,  # (P,) each pair's expert
    top_k,
    n,  # I
    k,  # H
    stride_xm,
    stride_we,
    stride_wn,
    stride_am,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(Ids + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    first = (tl.arange(0, 16) == 0)[:, None]  # x rides in row 0 of a 16-row tile; the rest are 0
    x_row = X + (pair // top_k) * stride_xm + tl.zeros([16, 1], tl.int64)  # (16, 1)
    g_rows = W13 + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
    u_rows = g_rows + n * stride_wn
    acc_g = tl.zeros([16, BLOCK_N], tl.float32)
    acc_u = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        x = tl.load(x_row + offs_k[None, :], mask=first & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc_g += _dot_t(x, tl.load(g_rows + offs_k[None, :], mask=w_mask, other=0.0), IEEE)
        acc_u += _dot_t(x, tl.load(u_rows + offs_k[None, :], mask=w_mask, other=0.0), IEEE)
    g, u = tl.sum(acc_g, 0), tl.sum(acc_u, 0)  # (BLOCK_N,) row 0 (the other rows add zeros)
    act = g / (1.0 + tl.exp(-g)) * u  # silu(gate) * up, rounded once
    tl.store(Act + pair * stride_am + offs_n, act.to(Act.dtype.element_ty), mask=n_mask)


@triton.jit
def _pair_down_kernel(
    Act,  # (P, I), row = pair
    W2,  # (E, H, I)
    Out,  # (T, H) out (may be Res)
    Weights,  # (P,) float32 routing weights
    Ids,  # (P,)
    Res,  # (T, H) the residual (ADD_RES), else unused
    n,  # H
    k,  # I
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_rm,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,  # TOP_K rounded up to a power of two
    RENORMALIZE: tl.constexpr,
    ADD_RES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    first = (tl.arange(0, 16) == 0)[:, None]
    zero_rows = tl.zeros([16, 1], tl.int64)
    total = 1.0
    if RENORMALIZE:  # the sum of the token's K weights, in slot order
        slots = tl.arange(0, K_PAD)
        total = tl.sum(tl.load(Weights + token * TOP_K + slots, mask=slots < TOP_K, other=0.0), 0)
    steps = tl.cdiv(k, BLOCK_K)
    y = tl.zeros([BLOCK_N], tl.float32)  # sum over the K pairs, in slot order
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for it in range(0, TOP_K * steps):  # one loop over (pair, K step): one pipeline, no restarts
        j = it // steps
        k0 = (it - j * steps) * BLOCK_K
        pair = token * TOP_K + j
        expert = tl.load(Ids + pair).to(tl.int64)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        a = tl.load(
            Act + pair * stride_am + zero_rows + offs_k[None, :], mask=first & k_mask[None, :], other=0.0
        )
        w_rows = W2 + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += _dot_t(a, w, IEEE)
        last = k0 + BLOCK_K >= k  # this pair's product is complete
        weight = tl.load(Weights + pair) / total
        prod = tl.sum(acc, 0).to(Out.dtype.element_ty).to(tl.float32) * weight  # rounded, then scaled
        y = tl.where(last, y + prod.to(Out.dtype.element_ty).to(tl.float32), y)
        acc = tl.where(last, 0.0, acc)
    out = y.to(Out.dtype.element_ty)
    if ADD_RES:
        res = tl.load(Res + token * stride_rm + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        out = (res + out.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + token * stride_om + offs_n, out, mask=n_mask)


def _pair_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    renormalize: bool,
    cfg: PairConfig,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """The decode path: gate/up per pair, then down with the k-sum (and the residual add) per token."""
    t, h = x.shape
    inter, top_k = w2.shape[2], ids.shape[1]
    p = t * top_k
    ieee = x.dtype == torch.float32
    most = 64 if ieee else 1 << 30  # float32 tiles are twice as large: shorter steps
    block_k = min(cfg.block_k, most, max(16, triton.next_power_of_2(h)))
    down_k = min(cfg.down_block_k, most, max(16, triton.next_power_of_2(inter)))
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    flat_ids = ids.reshape(-1)
    act = x.new_empty(p, inter)
    _pair_gate_up_kernel[(p, triton.cdiv(inter, cfg.block_n))](
        x, w13, act, flat_ids, top_k, inter, h, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=block_k, IEEE=ieee, **launch,
    )  # fmt: skip
    out = x.new_empty(t, h) if residual is None else residual
    _pair_down_kernel[(t, triton.cdiv(h, cfg.down_block_n))](
        act, w2, out, weights.reshape(-1).float().contiguous(), flat_ids, out, h, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), out.stride(0),
        TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)), RENORMALIZE=renormalize, ADD_RES=residual is not None,
        BLOCK_N=cfg.down_block_n, BLOCK_K=down_k, IEEE=ieee, **launch,
    )  # fmt: skip
    return out


def align_pairs(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (P,) each pair's expert -> (sorted_ids (max_padded,) int32 with P as padding,
    block_expert (max_blocks,) int32, total (1,) int32), all computed on the device."""
    p = ids.shape[0]
    max_padded = p + min(p, num_experts) * (block_m - 1)
    max_blocks = triton.cdiv(max_padded, block_m)
    e_pad = triton.next_power_of_2(num_experts + 1)  # one spare bin for masked loads
    dev = ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    cursor = torch.empty(e_pad, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](
        ids, sorted_ids, block_expert, total, cursor, p, num_experts, max_padded, max_blocks,
        E_PAD=e_pad, BLOCK_M=block_m, CHUNK=256, BLOCKS_CHUNK=max(1, 4096 // e_pad), num_warps=4,
    )  # fmt: skip
    return sorted_ids, block_expert, total


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    renormalize: bool,
    config: MoeConfig | PairConfig | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (T, H), w13 (E, 2I, H) [gate | up] rows, w2 (E, H, I), each token's K experts ids (T, K)
    with float32 weights (T, K) (divided by their sum here when `renormalize`) -> (T, H) = sum over
    them of weight * w2[e] @ (silu(gate_e x) * up_e x). Unit stride along H and I. With `residual`
    (T, H) contiguous, the result is added into it in place and it is returned. `config`: a launch
    shape of the grouped GEMMs or of the decode path (default: `pair_path` picks the path)."""
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
    if isinstance(config, PairConfig) or (config is None and pair_path(t, top_k, e)):
        cfg_pairs = config if isinstance(config, PairConfig) else PairConfig()
        return _pair_moe(x, w13, w2, weights, ids, renormalize, cfg_pairs, residual)
    cfg = config or moe_config(p, x.dtype)
    sorted_ids, block_expert, total = align_pairs(ids.reshape(-1), e, cfg.block_m)
    ieee = x.dtype == torch.float32
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    blocks = block_expert.shape[0]
    act = x.new_empty(p, inter)
    _gate_up_kernel[(blocks, triton.cdiv(inter, cfg.block_n))](
        x, w13, act, sorted_ids, block_expert, total, p, top_k, inter, h,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=ieee, **launch,
    )  # fmt: skip
    out = x.new_empty(p, h)
    _down_kernel[(blocks, triton.cdiv(h, cfg.block_n))](
        act, w2, out, weights.reshape(-1).float().contiguous(), sorted_ids, block_expert, total, p, h, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=ieee, **launch,
    )  # fmt: skip
    y = out.view(t, top_k, h).sum(dim=1)  # (T, H)
    return y if residual is None else residual.add_(y)

"""One token's routed experts (batch-1 decode of a mixture of experts) as two row GEMVs on the CUDA
cores, no sort, no padding, no atomics.

At one token the grouped GEMMs (`moe.py`) pad each of the K pairs to a 16-row tensor-core tile and
give each program 64 columns of one expert: a few hundred programs, the weights streamed at 2.3-3.3
TB/s. Here, as in `row.py`, a thread loads VEC (8) contiguous weights of a row and the x values
that go with them, widens to float32 and sums in registers; a (rows, CHUNKS) accumulator is reduced
once after the loop over K.

1. `_gate_up_row_kernel`, grid (cdiv(I, BLOCK_N), K): program (i, j) takes BLOCK_N gate rows and the
   matching up rows of slot j's expert -> silu(gate) x up into act (K, I), row = slot.
   ROUTE: the router's launch only wrote its partial logits (`moe._router_kernel` with TAIL off),
   and every program sums them in split order, rounds them to x's dtype and routes (`topk_tile`) by
   itself: no program of the router waits for the others and routes alone. Program (0, 0) writes
   the token's ids and weights (the op's outputs; the down kernel reads them).
2. `_down_row_kernel`, grid (cdiv(H, BLOCK_N),): a program takes BLOCK_N output rows of all K
   experts (a (K, BLOCK_N, CHUNKS, VEC) tile a step), so the k-sum happens in its registers: each
   expert's row rounded to the output dtype, scaled by its routing weight and rounded again, as the
   grouped down kernel's epilogue does, then summed in slot order (and added to the residual). No
   partial rows in memory, no counters: deterministic by construction.

The products' summation order differs from the tensor-core dot's, so results agree with the grouped
GEMMs within the dtype's rounding, not bit for bit; the routing is the same bits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..pdl import pdl_enter, pdl_launch, use_pdl
from .route import topk_tile

VEC = tl.constexpr(8)  # 16 bytes of 16-bit weights a thread loads at once


@dataclass(frozen=True)
class ExpertRowConfig:
    """Launch shape: BLOCK_N weight rows a block (of each of gate and up; of each expert for down),
    BLOCK_K columns a step; gate/up: `iters` blocks of rows a program, one after the other (its
    routing, where it routes, done once for them)."""

    block_n: int = 4
    block_k: int = 1024
    num_warps: int = 4
    iters: int = 1


UP_CONFIG = ExpertRowConfig(4, 1024, 4)  # Qwen3-30B-A3B: 192 x 8 programs of 16 KB a step
DOWN_CONFIG = ExpertRowConfig(2, 256, 4)  # 1,024 programs, 8 experts x 2 rows x 256 columns a step


def row_path_enabled() -> bool:
    """MINISGL_MOE_B1 (default 0, opt-in for A/B: they lost to the grouped GEMMs on an H200, 3.46 against
    3.09 ms a step): one token's experts through these row GEMVs (0: the grouped GEMMs)."""
    return os.environ.get("MINISGL_MOE_B1", "0") not in ("", "0")


def route_in_gate_up() -> bool:
    """MINISGL_MOE_B1_ROUTE (default 1): with the row GEMVs, the routing inside gate/up's programs (0:
    the router's last program routes, as for more tokens)."""
    return os.environ.get("MINISGL_MOE_B1_ROUTE", "1") not in ("", "0")


def config_from_env(name: str, default: ExpertRowConfig) -> ExpertRowConfig:
    """A launch shape from the env var `name` ("block_n,block_k,num_warps"), for tuning; else default."""
    spec = os.environ.get(name)
    return ExpertRowConfig(*(int(v) for v in spec.split(","))) if spec else default


@triton.jit
def _route_from_partials(
    Partial,  # (SPLITS, row stride PART_T, E_ROUTE) float32: the router's partial logits, token at row 0
    num_experts,
    DTYPE: tl.constexpr,  # the logits' dtype (x's): the sum is rounded to it, as the projection rounds
    SPLITS: tl.constexpr,
    PART_T: tl.constexpr,
    E_ROUTE: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """-> the token's top-k (1, K_PAD) probabilities and expert ids, the router's tail's bits: the
    splits summed in order from zero, rounded, softmax and top-k (`topk_tile`)."""
    experts = tl.arange(0, E_ROUTE)[None, :]  # (1, E_ROUTE)
    logits = tl.zeros([1, E_ROUTE], tl.float32)
    for s in tl.static_range(SPLITS):
        logits += tl.load(Partial + s * PART_T * E_ROUTE + experts)
    logits = logits.to(DTYPE).to(tl.float32)
    logits = tl.where(experts < num_experts, logits, -float("inf"))
    return topk_tile(logits, TOP_K, K_PAD, E_ROUTE, RENORMALIZE)


@triton.jit
def _gate_up_row_kernel(
    X,  # (H,) the token's input, unit stride
    W13,  # (E, 2I, H): rows [gate | up] of each expert, unit stride in H
    Act,  # (K, I) out, row = slot
    Ids,  # (K,) int64: the token's experts (ROUTE: written here by program (0, 0))
    Weights,  # ROUTE: (K,) float32 out, else unused
    Partial,  # ROUTE: the router's partial logits, else unused
    n,  # I
    k,  # H
    num_experts,
    stride_we,
    stride_wn,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    ROUTE: tl.constexpr,
    SPLITS: tl.constexpr,
    PART_T: tl.constexpr,
    E_ROUTE: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ITERS: tl.constexpr,
    PDL: tl.constexpr,
):
    CHUNKS: tl.constexpr = BLOCK_K // VEC
    pid_n, slot = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, CHUNKS)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # (CHUNKS, VEC)
    pdl_enter(PDL)
    if ROUTE:
        chosen_p, chosen_e = _route_from_partials(
            Partial, num_experts, X.dtype.element_ty, SPLITS, PART_T, E_ROUTE, TOP_K, K_PAD, RENORMALIZE
        )  # (1, K_PAD) each
        slots = tl.arange(0, K_PAD)[None, :]
        expert = tl.sum(tl.sum(tl.where(slots == slot, chosen_e, 0), axis=1), axis=0)
        first = slots + (pid_n + slot) * K_PAD < TOP_K  # program (0, 0)'s slots
        tl.store(Ids + slots, chosen_e, mask=first)
        tl.store(Weights + slots, chosen_p, mask=first)
    else:
        expert = tl.load(Ids + slot).to(tl.int64)
    for it in range(ITERS):
        offs_n = (pid_n * ITERS + it) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n
        safe_n = tl.where(n_mask, offs_n, 0)  # rows past the end read row 0: no load masks in N
        g_rows = W13 + expert * stride_we + safe_n[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
        u_rows = g_rows + n * stride_wn
        acc_g = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
        acc_u = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            cols = k0 + offs  # (CHUNKS, VEC)
            c_mask = cols < k
            x = tl.load(X + cols, mask=c_mask, other=0.0).to(tl.float32)
            wg = tl.load(g_rows[:, :, None] + cols[None, :, :], mask=c_mask[None, :, :], other=0.0)
            wu = tl.load(u_rows[:, :, None] + cols[None, :, :], mask=c_mask[None, :, :], other=0.0)
            acc_g += tl.sum(wg.to(tl.float32) * x[None, :, :], axis=2)
            acc_u += tl.sum(wu.to(tl.float32) * x[None, :, :], axis=2)
        g = tl.sum(acc_g, axis=1)  # (BLOCK_N,)
        u = tl.sum(acc_u, axis=1)
        act = g / (1.0 + tl.exp(-g)) * u  # silu(gate) * up, rounded once
        tl.store(Act + slot * n + offs_n, act.to(Act.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_row_kernel(
    Act,  # (K, I) contiguous, row = slot
    W2,  # (E, H, I), unit stride in I
    Out,  # (H,) out: the sum over the K experts (+ Res); may be Res
    Res,  # (H,) the residual (ADD_RES), else unused
    Ids,  # (K,) int64
    Weights,  # (K,) float32
    n,  # H
    k,  # I
    stride_we,
    stride_wn,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ADD_RES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    CHUNKS: tl.constexpr = BLOCK_K // VEC
    offs = tl.arange(0, CHUNKS)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # (CHUNKS, VEC)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    safe_n = tl.where(n_mask, offs_n, 0)
    slots = tl.arange(0, K_PAD)
    s_mask = slots < TOP_K
    pdl_enter(PDL)
    experts = tl.load(Ids + slots, mask=s_mask, other=0).to(tl.int64)  # (K_PAD,)
    w_rows = W2 + experts[:, None] * stride_we + safe_n[None, :].to(tl.int64) * stride_wn  # (K_PAD, BLOCK_N)
    a_rows = Act + slots[:, None] * k  # (K_PAD, 1)
    acc = tl.zeros([K_PAD, BLOCK_N, CHUNKS], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + offs
        c_mask = cols < k
        a_mask = s_mask[:, None, None] & c_mask[None, :, :]
        a = tl.load(a_rows[:, :, None] + cols[None, :, :], mask=a_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows[:, :, None, None] + cols[None, None, :, :], mask=a_mask[:, None, :, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[:, None, :, :], axis=3)  # (K_PAD, BLOCK_N, CHUNKS)
    y = tl.sum(acc, axis=2)  # (K_PAD, BLOCK_N): each expert's rows
    weight = tl.load(Weights + slots, mask=s_mask, other=0.0)  # (K_PAD,) float32
    if RENORMALIZE:  # divided by the sum of the K weights, summed in slot order
        total = 0.0
        for j in tl.static_range(TOP_K):
            total += tl.sum(tl.where(slots == j, weight, 0.0), axis=0)
        weight = weight / total
    dt = Out.dtype.element_ty
    part = (y.to(dt).to(tl.float32) * weight[:, None]).to(dt).to(tl.float32)  # the grouped epilogue's bits
    out = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):  # slot order (adding the other slots' zeros is exact)
        out += tl.sum(tl.where(slots[:, None] == j, part, 0.0), axis=0)
    y_out = out.to(dt)
    if ADD_RES:
        res = tl.load(Res + offs_n, mask=n_mask, other=0.0)
        y_out = (res.to(tl.float32) + y_out.to(tl.float32)).to(dt)
    tl.store(Out + offs_n, y_out, mask=n_mask)


@dataclass(frozen=True)
class RouterPartials:
    """What the router's launch left for gate/up to route from: partial logits (splits, part_t,
    e_route) float32 (the token at row 0), and whether to divide the top-k weights by their sum."""

    partial: torch.Tensor
    num_experts: int
    renormalize: bool


def experts_one_token(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    renormalize: bool,
    residual: torch.Tensor | None = None,
    route: RouterPartials | None = None,
    up: ExpertRowConfig | None = None,
    down: ExpertRowConfig | None = None,
) -> torch.Tensor:
    """`fused_moe` for one token: x (1, H) contiguous, w13 (E, 2I, H), w2 (E, H, I) unit stride in
    their last dimension, ids (1, K) int64 distinct experts with float32 weights (1, K) -> (1, H), or
    added into `residual` (1, H) contiguous in place. route: ids and weights are outputs, written by
    gate/up's programs routing from the router's partial logits (`renormalize` then applies there)."""
    h = x.shape[1]
    e, two_i, _ = w13.shape
    inter, top_k = two_i // 2, ids.shape[1]
    if x.shape[0] != 1 or not x.is_contiguous() or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError(f"experts_one_token: x {tuple(x.shape)} {x.stride()}, w13 {tuple(w13.shape)}")
    if (
        w13.shape[2] != h
        or w2.shape != (e, h, inter)
        or ids.shape != (1, top_k)
        or weights.shape != ids.shape
    ):
        raise ValueError(f"experts_one_token: w2 {tuple(w2.shape)}, ids {tuple(ids.shape)}")
    if residual is not None and (residual.shape != (1, h) or not residual.is_contiguous()):
        raise ValueError(f"experts_one_token: residual {tuple(residual.shape)}")
    up = up or config_from_env("MINISGL_MOE_B1_UP", UP_CONFIG)
    down = down or config_from_env("MINISGL_MOE_B1_DOWN_SHAPE", DOWN_CONFIG)
    pdl, k_pad = use_pdl(x), max(2, triton.next_power_of_2(top_k))
    act = x.new_empty(top_k, inter)
    part = route.partial if route is not None else weights
    _gate_up_row_kernel[(triton.cdiv(inter, up.block_n * up.iters), top_k)](
        x, w13, act, ids, weights, part, inter, h, route.num_experts if route else e,
        w13.stride(0), w13.stride(1), TOP_K=top_k, K_PAD=k_pad, ROUTE=route is not None,
        SPLITS=part.shape[0] if route else 1, PART_T=part.shape[1] if route else 1,
        E_ROUTE=part.shape[2] if route else 1, RENORMALIZE=route is not None and route.renormalize,
        BLOCK_N=up.block_n, BLOCK_K=_block_k(up, h), ITERS=up.iters, PDL=pdl, num_warps=up.num_warps, num_stages=1,
        **pdl_launch(pdl),
    )  # fmt: skip
    out = x.new_empty(1, h) if residual is None else residual
    _down_row_kernel[(triton.cdiv(h, down.block_n),)](
        act, w2, out, out, ids, weights, h, inter, w2.stride(0), w2.stride(1), TOP_K=top_k, K_PAD=k_pad,
        RENORMALIZE=renormalize and route is None, ADD_RES=residual is not None, BLOCK_N=down.block_n,
        BLOCK_K=_block_k(down, inter), PDL=pdl, num_warps=down.num_warps, num_stages=1, **pdl_launch(pdl),
    )  # fmt: skip
    return out


def _block_k(cfg: ExpertRowConfig, k: int) -> int:
    """The step over K: the shape's, or K rounded up to a power of two (>= VEC) where that is less."""
    return min(cfg.block_k, max(16, triton.next_power_of_2(k)))

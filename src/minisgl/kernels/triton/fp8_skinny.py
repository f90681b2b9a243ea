"""The W8A8 matmul of a decode batch (tens to a few hundred rows) on the fp8 tensor cores:
y = (xq * xs) @ (wq * ws)^T, x quantized per row (scales (M, 1)), W per output channel (scales (N,)),
rounded once to y's dtype, optionally added into the residual (`y` is then the residual, in place).
`skinny_matmul` is the same kernel for 16-bit x and W, unscaled.

At these sizes the matmul streams its weight, and the question is how many SMs stream it. cuBLASLt
(`torch._scaled_mm`) tiles them 128 x 128 whatever the rows: o and down of an 8B model (N = 4,096)
become 32 tiles on 132 SMs. Here a program takes BLOCK_M rows of x and BLOCK_N rows of W (narrow, so
that N = 4,096 still gives every SM work) and, with SPLIT_K > 1, one of SPLIT_K equal slices of K.
The splits' float32 tiles go to a scratch buffer and the last program of a tile to finish (a counter
per tile, left at zero for the next launch) sums them in split order (deterministic), then applies
the scales, the bias and the residual add: no reduce kernel, no memset. Programs of one W tile are
neighbours in the launch order (x's row tiles vary fastest), so each W tile leaves HBM once.

SWAP: the dot as W @ x^T, so W's rows fill the tensor core's 64-row side and x's rows its narrow
side (fewer padded rows when the batch is small); the result is transposed back for the epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .counters import zeroed_counters
from .gemv.tile import store_rounded
from .pdl import pdl_enter, pdl_launch, use_pdl


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch shape: BLOCK_M rows of x, BLOCK_N rows of W, BLOCK_K columns a step, SPLIT_K slices of K."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    swap: bool = False

    def fits(self, m: int, n: int, k: int) -> bool:
        """Whether this shape takes (m, n, k) without masks on W or K."""
        return m > 0 and n % self.block_n == 0 and k % (self.block_k * self.split_k) == 0


@triton.jit
def _finish(acc, XS, WS, Bias, Y, offs_m, offs_n, m, stride_xs, stride_ym,
            SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_RES: tl.constexpr):  # fmt: skip
    """acc (BLOCK_M, BLOCK_N) float32 -> y = acc (* xs * ws) (+ bias), rounded once (+ the residual)."""
    y = acc
    if SCALED:
        xs = tl.load(XS + (offs_m % m).to(tl.int64) * stride_xs)  # (BLOCK_M,)
        ws = tl.load(WS + offs_n)  # (BLOCK_N,)
        y = y * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        y += tl.load(Bias + offs_n).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    store_rounded(y_ptrs, y, (offs_m < m)[:, None], ADD_RES)


@triton.jit
def _skinny_kernel(
    X,  # (M, K) fp8 (or 16-bit, unscaled), unit stride in K
    XS,  # SCALED: (M, 1) float32
    W,  # (N, K) in X's dtype, unit stride in K
    WS,  # SCALED: (N,) float32
    Bias,  # (N,) or unused
    Y,  # (M, N) output, or the residual updated in place (ADD_RES)
    Part,  # SPLIT_K > 1: float32 (SPLIT_K, tiles, BLOCK_M, BLOCK_N) scratch
    Count,  # SPLIT_K > 1: int32 (tiles,), zero, left zero
    m,
    k,
    stride_xm,
    stride_xs,
    stride_wn,
    stride_ym,
    SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWAP: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_len = k // SPLIT_K  # the launch checks k % (SPLIT_K * BLOCK_K) == 0
    offs_k = pid_k * k_len + tl.arange(0, BLOCK_K)
    x_rows = (offs_m % m).to(tl.int64) * stride_xm  # rows past the end read a real row: no masks
    w_rows = offs_n.to(tl.int64) * stride_wn
    if SWAP:
        x_ptrs = X + x_rows[None, :] + offs_k[:, None]  # (BLOCK_K, BLOCK_M), K-major
        w_ptrs = W + w_rows[:, None] + offs_k[None, :]  # (BLOCK_N, BLOCK_K)
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        x_ptrs = X + x_rows[:, None] + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
        w_ptrs = W + w_rows[None, :] + offs_k[:, None]  # (BLOCK_K, BLOCK_N), K-major
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    pdl_enter(PDL)
    for _ in range(0, k_len, BLOCK_K):
        if SWAP:
            acc_t = tl.dot(tl.load(w_ptrs), tl.load(x_ptrs), acc_t)
        else:
            acc = tl.dot(tl.load(x_ptrs), tl.load(w_ptrs), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP:
        acc = tl.trans(acc_t)
    if SPLIT_K == 1:
        _finish(acc, XS, WS, Bias, Y, offs_m, offs_n, m, stride_xs, stride_ym, SCALED, HAS_BIAS, ADD_RES)
    else:
        tiles = tl.num_programs(0) * tl.num_programs(1)
        tile = pid_n * tl.num_programs(0) + pid_m
        cell = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(Part + (pid_k * tiles + tile).to(tl.int64) * (BLOCK_M * BLOCK_N) + cell, acc)
        # The barrier orders this program's stores before its release; the acquire orders the other
        # splits' stores before the loads below.
        tl.debug_barrier()
        if tl.atomic_add(Count + tile, 1, sem="acq_rel") == SPLIT_K - 1:
            tl.atomic_xchg(Count + tile, 0)  # left at zero for the next launch
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):  # in split order, whichever finished last
                total += tl.load(Part + (s * tiles + tile).to(tl.int64) * (BLOCK_M * BLOCK_N) + cell,
                                 cache_modifier=".cg")  # fmt: skip
            _finish(
                total, XS, WS, Bias, Y, offs_m, offs_n, m, stride_xs, stride_ym, SCALED, HAS_BIAS, ADD_RES
            )


def skinny_fp8_matmul(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: SkinnyConfig,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """xq (M, K) fp8 with per-row scales xs (M, 1) @ wq (N, K)^T fp8 with per-row scales ws (N,)
    (+ bias) -> (M, N) in out_dtype; with `residual` (M, N) contiguous, added into it in place and
    returned. `config.fits(M, N, K)` must hold."""
    m, n = xq.shape[0], wq.shape[0]
    if xs.shape != (m, 1) or ws.shape != (n,):
        raise ValueError(f"skinny_fp8_matmul: scales {tuple(xs.shape)} / {tuple(ws.shape)} for ({m}, {n})")
    return _launch(xq, xs, wq, ws, bias, out_dtype, config, residual)


def skinny_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same kernel unscaled, for 16-bit x (M, K) and weight (N, K) of one dtype: x @ W^T (+ bias)
    -> (M, N) in x's dtype, or added into `residual` in place."""
    if weight.dtype != x.dtype:
        raise ValueError(f"skinny_matmul: x {x.dtype} against weight {weight.dtype}")
    return _launch(x, None, weight, None, bias, x.dtype, config, residual)


def _launch(
    x: torch.Tensor,
    xs: torch.Tensor | None,
    w: torch.Tensor,
    ws: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: SkinnyConfig,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    if x.dim() != 2 or not config.fits(m, n, k) or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"skinny matmul: x {tuple(x.shape)}, w {tuple(w.shape)} in {config}")
    if residual is not None and (residual.shape != (m, n) or not residual.is_contiguous()):
        raise ValueError(f"skinny matmul: residual {tuple(residual.shape)} for an output ({m}, {n})")
    out = torch.empty(m, n, dtype=out_dtype, device=x.device) if residual is None else residual
    grid = (triton.cdiv(m, config.block_m), n // config.block_n, config.split_k)
    tiles = grid[0] * grid[1]
    if config.split_k > 1:
        part = torch.empty(config.split_k * tiles * config.block_m * config.block_n, dtype=torch.float32,
                           device=x.device)  # fmt: skip
        count = zeroed_counters(tiles, x.device, "skinny")
    else:
        part = count = out
    pdl = use_pdl(x)
    _skinny_kernel[grid](
        x, w if xs is None else xs, w, w if ws is None else ws, w if bias is None else bias, out, part, count,
        m, k, x.stride(0), 0 if xs is None else xs.stride(0), w.stride(0), out.stride(0),
        SCALED=xs is not None, HAS_BIAS=bias is not None, ADD_RES=residual is not None, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k, SWAP=config.swap, PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(pdl),
    )  # fmt: skip
    return out

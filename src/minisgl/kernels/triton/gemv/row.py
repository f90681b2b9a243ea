"""fp8 projections of a few rows (batch-1 decode) on the CUDA cores: y = x @ (W * scale)^T, W fp8
(N, K) with a float32 scale per output channel.

At one row the tensor-core GEMV (`tile.gemv_fp8`) is paced by padding the row to a 16-row tile and
moving each widened weight tile through shared memory, not by the bytes. Here each program streams
BLOCK_N whole rows of W, a step of BLOCK_K columns being one chunk of VEC (8) columns per thread: a
thread loads 8 bytes of each row and the 16 bytes of x that go with them (no shuffle between the two
layouts), widens to float32 and sums in registers into a (BLOCK_N, CHUNKS) accumulator, reduced over
the chunks once after the loop. Rows of x are the fast grid axis: a second row's reads hit the L2.
Fused, each chosen at compile time: the RMSNorm before (`norm`: x^2 summed as x streams, the row
scale applied to the result), SiLU x up after (`gated`, W = [gate | up] (2I, K): a program takes rows
j and I + j, writes silu(g) * u (M, I)), the residual add (in place) and a bias. Math in float32;
the output is rounded once (as the other GEMV).

Two more levers for short kernels (qkv and o of an 8B model stream 16-25 MB: a few microseconds):
- `prefetch`: the program's first weight tile is loaded before PDL's wait (`pdl.pdl_enter`). The
  weights are no output of the kernel before, so with PDL that tile streams while the kernel before
  finishes; x, the norm weight and the residual are read after the wait.
- one step over K (BLOCK_K >= K, `RESIDENT`): x (times the norm weight) is loaded once into
  registers, and a program may take `iters` blocks of BLOCK_N rows one after the other, the next
  block's tile loaded before this block's math; every program otherwise re-reads x (and g) from the
  L2, as many bytes as its weight rows at BLOCK_N = 4 with the norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..pdl import pdl_enter, pdl_launch, use_pdl
from .tile import store_rounded

MAX_ROWS = 4  # more rows re-read the weight from L2 once per row: the tensor-core GEMV takes them


@dataclass(frozen=True)
class RowGemvConfig:
    """Launch shape: BLOCK_N weight rows per block (per half when gated), BLOCK_K columns a step,
    `iters` blocks of rows per program and `prefetch`: the program's first weight tile loaded before
    PDL's wait for the kernel before (the weights are no output of it), so that it streams during
    that kernel's tail. Both only where one step spans K (x stays in registers)."""

    block_n: int = 4
    block_k: int = 1024
    num_warps: int = 4
    iters: int = 1
    prefetch: bool = False


VEC = tl.constexpr(8)  # weights a thread loads at once and sums in its registers (as many as x's 16 bytes)


@triton.jit
def _load_tile(rows, offs, k):
    """The (BLOCK_N, CHUNKS, VEC) fp8 tile of `rows` (BLOCK_N, 1) at column offsets `offs` (CHUNKS, VEC)."""
    return tl.load(rows[:, :, None] + offs[None, :, :], mask=(offs < k)[None, :, :], other=0.0)


@triton.jit
def _row_ptrs(W, first, n_out, stride_wn, BLOCK_N: tl.constexpr):
    """Block of rows from `first`: offsets (BLOCK_N,), their mask, the offsets clamped into range
    (rows past the end read row 0: no load masks in N) and the weight row pointers (BLOCK_N, 1)."""
    offs_n = first + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    safe_n = tl.where(n_mask, offs_n, 0)
    return offs_n, n_mask, safe_n, W + safe_n[:, None].to(tl.int64) * stride_wn


@triton.jit
def _finish(
    acc, acc_up, rstd, offs_n, n_mask, safe_n, n_out, WScale, Bias, y_row,
    NORM: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_RES: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """A block's epilogue: the chunk sums (BLOCK_N, CHUNKS) summed, scaled, normed, biased, gated,
    rounded once and stored (added into the residual where ADD_RES)."""
    y = tl.sum(acc, axis=1)  # (BLOCK_N,)
    if SCALED:
        y = y * tl.load(WScale + safe_n)
    if NORM:
        y = y * rstd
    if HAS_BIAS:
        y += tl.load(Bias + safe_n).to(tl.float32)
    if GATED:
        up = tl.sum(acc_up, axis=1)
        if SCALED:
            up = up * tl.load(WScale + n_out + safe_n)
        if NORM:
            up = up * rstd
        if HAS_BIAS:
            up += tl.load(Bias + n_out + safe_n).to(tl.float32)
        y = y / (1.0 + tl.exp(-y)) * up
    store_rounded(y_row + offs_n, y, n_mask, ADD_RES)


@triton.jit
def _gemv_row_kernel(
    X,  # (M, K), unit stride in K
    W,  # (N, K) fp8, unit stride in K; gated: [gate | up], N = 2 * n_out
    WScale,  # (N,) float32 (SCALED), else unused
    Bias,  # (N,) or unused
    NormW,  # (K,) or unused
    Y,  # (M, n_out) output, or the residual updated in place (ADD_RES)
    n_out,
    k,
    stride_xm,
    stride_wn,
    stride_ym,
    eps,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD_RES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ITERS: tl.constexpr,  # blocks of BLOCK_N rows a program; > 1 only where RESIDENT
    RESIDENT: tl.constexpr,  # BLOCK_K >= k: one step spans the row, x is loaded once
    PREFETCH: tl.constexpr,
    SCALED: tl.constexpr,  # fp8 weights with per-channel scales; else 16-bit weights, unscaled
    PDL: tl.constexpr,
):
    CHUNKS: tl.constexpr = BLOCK_K // VEC
    row = tl.program_id(0)
    first = tl.program_id(1) * (ITERS * BLOCK_N)
    up_off = n_out.to(tl.int64) * stride_wn  # GATED: from a gate row to its up row
    x_row = X + row.to(tl.int64) * stride_xm
    y_row = Y + row.to(tl.int64) * stride_ym
    # column offsets of one step: chunk c of VEC columns at c * VEC (CHUNKS, VEC)
    offs = tl.arange(0, CHUNKS)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    offs_n, n_mask, safe_n, w_rows = _row_ptrs(W, first, n_out, stride_wn, BLOCK_N)
    if PREFETCH:  # the weights are no output of the kernel before: their first tile needs no wait
        w = _load_tile(w_rows, offs, k)  # (BLOCK_N, CHUNKS, VEC)
        u = _load_tile(w_rows + up_off, offs, k) if GATED else w
    pdl_enter(PDL)
    if RESIDENT:  # x (and the norm) once; a program's blocks of rows, the next one's tile in flight
        if not PREFETCH:
            w = _load_tile(w_rows, offs, k)
            u = _load_tile(w_rows + up_off, offs, k) if GATED else w
        x = tl.load(x_row + offs, mask=offs < k, other=0.0).to(tl.float32)  # (CHUNKS, VEC)
        rstd = 1.0
        if NORM:
            rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / k + eps)
            x = x * tl.load(NormW + offs, mask=offs < k, other=0.0).to(tl.float32)
        for i in tl.static_range(ITERS):
            if i + 1 < ITERS:  # the next block's tile before this block's math
                offs_n1, n_mask1, safe_n1, w_rows1 = _row_ptrs(
                    W, first + (i + 1) * BLOCK_N, n_out, stride_wn, BLOCK_N
                )
                w1 = _load_tile(w_rows1, offs, k)
                u1 = _load_tile(w_rows1 + up_off, offs, k) if GATED else w1
            acc = tl.sum(w.to(tl.float32) * x[None, :, :], axis=2)  # (BLOCK_N, CHUNKS)
            acc_up = tl.sum(u.to(tl.float32) * x[None, :, :], axis=2) if GATED else acc
            _finish(acc, acc_up, rstd, offs_n, n_mask, safe_n, n_out, WScale, Bias, y_row,
                    NORM, GATED, HAS_BIAS, ADD_RES, SCALED)  # fmt: skip
            if i + 1 < ITERS:
                offs_n, n_mask, safe_n, w, u = offs_n1, n_mask1, safe_n1, w1, u1
    else:  # one block of rows, K in steps; x is read with each step (no PREFETCH: see the wrapper)
        acc = tl.zeros([BLOCK_N, CHUNKS], tl.float32)  # each thread's chunk sums: no shuffles in the loop
        acc_up = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
        ss = tl.zeros([CHUNKS], tl.float32)  # NORM: x^2 summed over the steps
        for k0 in range(0, k, BLOCK_K):
            cols = k0 + offs  # (CHUNKS, VEC)
            x = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
            if NORM:
                ss += tl.sum(x * x, axis=1)
                x = x * tl.load(NormW + cols, mask=cols < k, other=0.0).to(tl.float32)
            w = _load_tile(w_rows, cols, k)  # (BLOCK_N, CHUNKS, VEC)
            u = _load_tile(w_rows + up_off, cols, k) if GATED else w  # both halves in flight first
            acc += tl.sum(w.to(tl.float32) * x[None, :, :], axis=2)
            if GATED:
                acc_up += tl.sum(u.to(tl.float32) * x[None, :, :], axis=2)
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / k + eps) if NORM else 1.0
        _finish(acc, acc_up, rstd, offs_n, n_mask, safe_n, n_out, WScale, Bias, y_row,
                NORM, GATED, HAS_BIAS, ADD_RES, SCALED)  # fmt: skip


def gemv_fp8_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    gated: bool = False,
    config: RowGemvConfig = RowGemvConfig(),
) -> torch.Tensor:
    """x (M, K), M <= MAX_ROWS, unit stride in K, @ (weight (N, K) fp8 * scale (N,) float32)^T;
    scale None: weight in a 16-bit dtype (or x's), unscaled (batch-1 bf16 projections).

    norm (g (K,), eps): project rmsnorm(x) * g instead of x. gated: weight is [gate | up] and the
    result is silu(gate) * up, (M, N / 2). residual (M, N') contiguous: added into in place and
    returned; else a new tensor in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    n_out = n // 2 if gated else n
    if m > MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1 or n % (1 + gated):
        raise ValueError(f"gemv_fp8_rows: x {tuple(x.shape)} against weight {tuple(weight.shape)}")
    if scale is not None and (scale.shape != (n,) or scale.dtype != torch.float32):
        raise ValueError(f"gemv_fp8_rows: scale {tuple(scale.shape)} {scale.dtype} for {n} rows")
    if scale is None and weight.dtype not in (torch.bfloat16, torch.float16, x.dtype):
        raise ValueError(f"gemv_fp8_rows: an unscaled weight in {weight.dtype}")
    if residual is not None and (residual.shape != (m, n_out) or not residual.is_contiguous()):
        raise ValueError(f"gemv_fp8_rows: residual {tuple(residual.shape)} for an output ({m}, {n_out})")
    out = x.new_empty(m, n_out) if residual is None else residual
    if m == 0:
        return out
    pdl = use_pdl(x)
    block_k = min(config.block_k, max(16, triton.next_power_of_2(k)))  # a power of two >= VEC
    resident = block_k >= k
    if (config.iters > 1 or config.prefetch) and not resident:
        # a tile loaded before the loop and carried into it made the K loop 1.5x slower (H200)
        raise ValueError(f"gemv_fp8_rows: {config} needs one step over K = {k}")
    rows_per_program = config.block_n * config.iters
    _gemv_row_kernel[(m, triton.cdiv(n_out, rows_per_program))](
        x, weight, weight if scale is None else scale, weight if bias is None else bias, x if norm is None else norm[0], out,
        n_out, k, x.stride(0), weight.stride(0), out.stride(0), 0.0 if norm is None else norm[1],
        NORM=norm is not None, GATED=gated, HAS_BIAS=bias is not None, ADD_RES=residual is not None,
        BLOCK_N=config.block_n, BLOCK_K=block_k, ITERS=config.iters, RESIDENT=resident,
        PREFETCH=config.prefetch, SCALED=scale is not None, PDL=pdl, num_warps=config.num_warps, num_stages=1, **pdl_launch(pdl),
    )  # fmt: skip
    return out

"""fp8 projections of a few rows (batch-1 decode) on the CUDA cores: y = x @ (W * scale)^T, W fp8
(N, K) with a float32 scale per output channel.

At one row the tensor-core GEMV (`gemv.gemv_fp8`) is paced by padding the row to a 16-row tile and
moving each widened weight tile through shared memory, not by the bytes. Here each program streams
BLOCK_N whole rows of W, a step of BLOCK_K columns being one chunk of VEC (8) columns per thread: a
thread loads 8 bytes of each row and the 16 bytes of x that go with them (no shuffle between the two
layouts), widens to float32 and sums in registers into a (BLOCK_N, CHUNKS) accumulator, reduced over
the chunks once after the loop. Rows of x are the fast grid axis: a second row's reads hit the L2.
Fused, each chosen at compile time: the RMSNorm before (`norm`: x^2 summed as x streams, the row
scale applied to the result), SiLU x up after (`gated`, W = [gate | up] (2I, K): a program takes rows
j and I + j, writes silu(g) * u (M, I)), the residual add (in place) and a bias. Math in float32;
the output is rounded once (as the other GEMV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gemv import store_rounded
from .pdl import pdl_enter, pdl_launch, use_pdl

MAX_ROWS = 4  # more rows re-read the weight from L2 once per row: the tensor-core GEMV takes them


@dataclass(frozen=True)
class RowGemvConfig:
    """Launch shape: BLOCK_N weight rows per program (per half when gated), BLOCK_K columns a step."""

    block_n: int = 4
    block_k: int = 1024
    num_warps: int = 4


VEC = tl.constexpr(8)  # weights a thread loads at once and sums in its registers (as many as x's 16 bytes)


@triton.jit
def _load_tile(rows, offs, k):
    """The (BLOCK_N, CHUNKS, VEC) fp8 tile of `rows` at column offsets `offs` (CHUNKS, VEC)."""
    return tl.load(rows[:, :, None] + offs[None, :, :], mask=(offs < k)[None, :, :], other=0.0)


@triton.jit
def _gemv_row_kernel(
    X,  # (M, K), unit stride in K
    W,  # (N, K) fp8, unit stride in K; gated: [gate | up], N = 2 * n_out
    WScale,  # (N,) float32
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
    PDL: tl.constexpr,
):
    CHUNKS: tl.constexpr = BLOCK_K // VEC
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    n_mask = offs_n < n_out
    safe_n = tl.where(n_mask, offs_n, 0)  # rows past the end read row 0: no load masks in N
    w_rows = W + safe_n[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
    up_rows = w_rows + n_out.to(tl.int64) * stride_wn  # GATED: the up half's rows
    x_row = X + row.to(tl.int64) * stride_xm
    # column offsets of one step: chunk c of VEC columns at c * VEC (CHUNKS, VEC)
    offs = tl.arange(0, CHUNKS)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    pdl_enter(PDL)
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
        u = _load_tile(up_rows, cols, k) if GATED else w  # both halves' loads in flight before the math
        acc += tl.sum(w.to(tl.float32) * x[None, :, :], axis=2)
        if GATED:
            acc_up += tl.sum(u.to(tl.float32) * x[None, :, :], axis=2)
    y = tl.sum(acc, axis=1) * tl.load(WScale + safe_n)  # (BLOCK_N,)
    if NORM:
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / k + eps)
        y = y * rstd
    if HAS_BIAS:
        y += tl.load(Bias + safe_n).to(tl.float32)
    if GATED:
        up = tl.sum(acc_up, axis=1) * tl.load(WScale + n_out + safe_n)
        if NORM:
            up = up * rstd
        if HAS_BIAS:
            up += tl.load(Bias + n_out + safe_n).to(tl.float32)
        y = y / (1.0 + tl.exp(-y)) * up
    store_rounded(Y + row.to(tl.int64) * stride_ym + offs_n, y, n_mask, ADD_RES)


def gemv_fp8_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    gated: bool = False,
    config: RowGemvConfig = RowGemvConfig(),
) -> torch.Tensor:
    """x (M, K), M <= MAX_ROWS, unit stride in K, @ (weight (N, K) fp8 * scale (N,) float32)^T.

    norm (g (K,), eps): project rmsnorm(x) * g instead of x. gated: weight is [gate | up] and the
    result is silu(gate) * up, (M, N / 2). residual (M, N') contiguous: added into in place and
    returned; else a new tensor in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    n_out = n // 2 if gated else n
    if m > MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1 or n % (1 + gated):
        raise ValueError(f"gemv_fp8_rows: x {tuple(x.shape)} against weight {tuple(weight.shape)}")
    if scale.shape != (n,) or scale.dtype != torch.float32:
        raise ValueError(f"gemv_fp8_rows: scale {tuple(scale.shape)} {scale.dtype} for {n} rows")
    if residual is not None and (residual.shape != (m, n_out) or not residual.is_contiguous()):
        raise ValueError(f"gemv_fp8_rows: residual {tuple(residual.shape)} for an output ({m}, {n_out})")
    out = x.new_empty(m, n_out) if residual is None else residual
    if m == 0:
        return out
    pdl = use_pdl(x)
    block_k = min(config.block_k, max(16, triton.next_power_of_2(k)))  # a power of two >= VEC
    _gemv_row_kernel[(m, triton.cdiv(n_out, config.block_n))](
        x, weight, scale, weight if bias is None else bias, x if norm is None else norm[0], out,
        n_out, k, x.stride(0), weight.stride(0), out.stride(0), 0.0 if norm is None else norm[1],
        NORM=norm is not None, GATED=gated, HAS_BIAS=bias is not None, ADD_RES=residual is not None,
        BLOCK_N=config.block_n, BLOCK_K=block_k, PDL=pdl,
        num_warps=config.num_warps, num_stages=1, **pdl_launch(pdl),
    )  # fmt: skip
    return out

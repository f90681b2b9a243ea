"""Matmuls of a few rows (the projections of a small decode batch) in Triton: y = x @ W^T (+ bias),
or `residual += x @ W^T` in place.

At a few rows a projection only streams its weight, so the question is how well the kernel keeps the
memory system busy. cuBLAS answers some decode shapes with split-K and a separate reduce kernel (the
o and down projections of Llama-3.1-8B), or with fewer tiles than the GPU has SMs (its fused qkv);
here every program streams BLOCK_N whole rows of W (no split-K, no reduce) and the rows of x ride
along, padded to one 16-row tensor-core tile. The residual add is the epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # the rows of x are padded to one 16-row tensor-core tile


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape: BLOCK_N weight rows per program, BLOCK_K columns per step of its loop."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _gemv_kernel(
    X,  # (M, K), unit stride in K
    W,  # (N, K), unit stride in K
    Bias,  # (N,) or unused
    Y,  # (M, N) output, or the residual updated in place (ADD_RES)
    m,
    n,
    k,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    ADD_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < n
    m_mask = offs_m < m
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm  # (BLOCK_M, 1)
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:  # float32 weights: full-precision dots (the tests' dtype)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))  # (BLOCK_M, BLOCK_K) @ (BLOCK_K, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(Y.dtype.element_ty)  # rounded once, as the reference rounds the projection
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if ADD_RES:
        y = (tl.load(y_ptrs, mask=out_mask, other=0.0).to(tl.float32) + y.to(tl.float32)).to(y.dtype)
    tl.store(y_ptrs, y, mask=out_mask)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    config: GemvConfig = GemvConfig(),
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias) for M <= 16, unit stride in K. With `residual` (M, N)
    contiguous, adds the result into it in place and returns it; else returns a new (M, N)."""
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if m > MAX_ROWS or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} against weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != (m, n) or not residual.is_contiguous()):
        raise ValueError(f"gemv: residual {tuple(residual.shape)} for an output ({m}, {n})")
    out = x.new_empty(m, n) if residual is None else residual
    if m == 0:
        return out
    ieee = weight.dtype == torch.float32
    block_k = min(128 if ieee else config.block_k, max(16, triton.next_power_of_2(k)))
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, weight if bias is None else bias, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ADD_RES=residual is not None,
        BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=block_k, IEEE=ieee,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out

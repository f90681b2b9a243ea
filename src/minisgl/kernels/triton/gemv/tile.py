"""Matmuls of a few rows (the projections of a small decode batch) in Triton: y = x @ W^T (+ bias),
or `residual += x @ W^T` in place.

At a few rows a projection only streams its weight, so the question is how well the kernel keeps the
memory system busy. cuBLAS answers some decode shapes with split-K and a separate reduce kernel (the
o and down projections of Llama-3.1-8B), or with fewer tiles than the GPU has SMs (its fused qkv);
here every program streams BLOCK_N whole rows of W (no split-K, no reduce) and the rows of x ride
along, padded to one 16-row tensor-core tile. The residual add is the epilogue.

fp8 weights (`gemv_fp8`) stream half the bytes: each tile is widened in registers to x's dtype
(bf16 through `fp8.widen_fp8`'s bit trick: the plain conversion would set the pace, not the bytes)
and the dot runs as for 16-bit weights; x is not quantized. Per-channel scales multiply the result
once, block scales each BLOCK_K (= the block's columns) step's partial product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..fp8 import WIDEN, widen_fp8
from ..pdl import pdl_enter, pdl_launch, use_pdl

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
    WScale,  # W_SCALE 1: (N,) float32; 2: (ceil(N / SCALE_N), ceil(K / BLOCK_K)) float32; else unused
    Bias,  # (N,) or unused
    Y,  # (M, N) output, or the residual updated in place (ADD_RES)
    m,
    n,
    k,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_ws,
    W_SCALE: tl.constexpr,  # 0: W in x's dtype; 1: fp8, a scale per row of W; 2: fp8, per block
    SCALE_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < n
    m_mask = offs_m < m
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm  # (BLOCK_M, 1)
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
    pdl_enter(PDL)
    scale_rows = WScale + (offs_n // SCALE_N).to(tl.int64) * stride_ws  # W_SCALE 2: (BLOCK_N,)
    wide: tl.constexpr = W_SCALE > 0 and not IEEE and X.dtype.element_ty == tl.bfloat16
    unit = WIDEN if wide else 1.0  # what `widen_fp8` took out
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if W_SCALE == 0 or IEEE or x.dtype == tl.float16:
            w = w.to(x.dtype)  # fp8 -> fp16: one instruction a pair
        else:
            w = widen_fp8(w)  # bf16, 2^-112 times the fp8 values (scaled back with the weight scales)
        if IEEE:  # float32 activations: full-precision dots (the tests' dtype)
            part = tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w))  # (BLOCK_M, BLOCK_K) @ (BLOCK_K, BLOCK_N)
        if W_SCALE == 2:
            part = part * (tl.load(scale_rows + k0 // BLOCK_K, mask=n_mask, other=0.0) * unit)[None, :]
        acc += part
    if W_SCALE == 1:
        acc = acc * (tl.load(WScale + offs_n, mask=n_mask, other=0.0) * unit)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    store_rounded(y_ptrs, acc, m_mask[:, None] & n_mask[None, :], ADD_RES)


@triton.jit
def store_rounded(y_ptrs, y, mask, ADD_RES: tl.constexpr):
    """y (float32) rounded once to y_ptrs' dtype, as the reference rounds; ADD_RES: plus what is there."""
    out = y.to(y_ptrs.dtype.element_ty)
    if ADD_RES:
        out = (tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + out.to(tl.float32)).to(out.dtype)
    tl.store(y_ptrs, out, mask=mask)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    config: GemvConfig = GemvConfig(),
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias) for M <= 16, unit stride in K. With `residual` (M, N)
    contiguous, adds the result into it in place and returns it; else returns a new (M, N)."""
    block_k = _block_k(x, weight.shape[1], config)
    return _launch(x, weight, None, 0, 1, block_k, bias, residual, config)


def _block_k(x: torch.Tensor, k: int, config: GemvConfig) -> int:
    return min(128 if x.dtype == torch.float32 else config.block_k, max(16, triton.next_power_of_2(k)))


def gemv_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    config: GemvConfig = GemvConfig(),
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`gemv` with an fp8 weight (N, K) and its float32 scales: (N,) per row, or per `block` (bn, bk)
    (ceil(N / bn), ceil(K / bk)), bk a power of two >= 16 (each step of the loop is one block).
    out_dtype: a new output's (default x's). fp16 x is the fast one: the weight widens to fp16 in one
    instruction a pair (a bf16 x takes `widen_fp8`'s few more)."""
    n, k = weight.shape
    if block is None:
        if scale.shape != (n,) or scale.dtype != torch.float32:
            raise ValueError(f"gemv_fp8: scale {tuple(scale.shape)} {scale.dtype} for {n} rows")
        return _launch(x, weight, scale, 1, 1, _block_k(x, k, config), bias, residual, config, out_dtype)
    bn, bk = block
    if bk < 16 or bk & (bk - 1) or scale.shape != (triton.cdiv(n, bn), triton.cdiv(k, bk)):
        raise ValueError(f"gemv_fp8: block {block} with scales {tuple(scale.shape)} for ({n}, {k})")
    return _launch(x, weight, scale, 2, bn, bk, bias, residual, config, out_dtype)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    w_scale: int,
    scale_n: int,
    block_k: int,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    config: GemvConfig,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if m > MAX_ROWS or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} against weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != (m, n) or not residual.is_contiguous()):
        raise ValueError(f"gemv: residual {tuple(residual.shape)} for an output ({m}, {n})")
    out = x.new_empty(m, n, dtype=out_dtype or x.dtype) if residual is None else residual
    if m == 0:
        return out
    pdl = use_pdl(x)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, weight if scale is None else scale, weight if bias is None else bias, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), 0 if scale is None else scale.stride(0),
        W_SCALE=w_scale, SCALE_N=scale_n, HAS_BIAS=bias is not None, ADD_RES=residual is not None,
        BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(pdl),
    )  # fmt: skip
    return out

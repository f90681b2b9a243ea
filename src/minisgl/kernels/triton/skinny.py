"""Matmuls of a few rows (decode steps of small batches) in Triton, with the element-wise work around
them fused in: the RMSNorm before a projection (each program computes its rows' statistics itself),
SiLU x up before the down projection, and the residual add after a projection.

y (M, N) = f(x) @ W^T (+ bias), W (N, K) row-major, M <= 16. One program per BLOCK_N output features
streams W once (the whole K); the M rows are padded to 16 for the tensor cores, so the only real
cost is reading W, as for a GEMV. Prologues (PRO): 0 none; 1 rmsnorm(x) * norm_w (the statistics in
float32, the normed x rounded to W's dtype and the product too, as the reference does); 2 silu(x[:, :K])
* x[:, K:] (x is a gate/up pair of width 2K). Epilogue: with a residual, `residual += y` in place
(y rounded to the dtype first, as the reference adds a rounded projection), else y is written out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_kernel(
    X,
    W,
    Bias,
    Y,  # (M, N) output, or the residual updated in place (ADD_RES)
    NormW,
    m,
    n,
    k,
    stride_xm,
    stride_wn,
    stride_ym,
    eps,
    PRO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < m
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    if PRO == 1:  # each row's mean square, over the whole row
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < k)[None, :], other=0.0)
            xs = xs.to(tl.float32)
            ss += tl.sum(xs * xs, 1)
        rstd = tl.rsqrt(ss / k + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        xm = m_mask[:, None] & k_mask[None, :]
        if PRO == 2:
            g = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0).to(tl.float32)
            u = tl.load(x_rows + k + offs_k[None, :], mask=xm, other=0.0).to(tl.float32)
            x = (g / (1.0 + tl.exp(-g)) * u).to(W.dtype.element_ty)
        else:
            x = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0)
            if PRO == 1:
                nw = tl.load(NormW + offs_k, mask=k_mask, other=0.0).to(tl.float32)
                x = (x.to(tl.float32) * rstd[:, None]).to(W.dtype.element_ty).to(tl.float32)
                x = (x * nw[None, :]).to(W.dtype.element_ty)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(Y.dtype.element_ty)
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if ADD_RES:
        res = tl.load(y_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        y = (res + y.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(y_ptrs, y, mask=out_mask)


MAX_ROWS = 16  # the kernel pads rows to one 16-row tensor-core tile


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """f(x) (M, K) @ weight (N, K)^T (+ bias) for M <= 16, f = rmsnorm(x) * norm[0] (eps norm[1]) with
    `norm`, silu(gate) * up with `gated` (x (M, 2K) laid out [gate | up]), else identity. With
    `residual` (M, N) contiguous, adds the result into it in place and returns it."""
    m = x.shape[0]
    n, k = weight.shape
    kx = 2 * k if gated else k
    if m > MAX_ROWS or x.dim() != 2 or x.shape[1] != kx or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} against weight {tuple(weight.shape)}")
    if norm is not None and gated:
        raise ValueError("skinny_linear: one prologue at a time")
    if residual is not None:
        if residual.shape != (m, n) or not residual.is_contiguous():
            raise ValueError(f"skinny_linear: residual {tuple(residual.shape)} for an output ({m}, {n})")
        out = residual
    else:
        out = x.new_empty(m, n)
    if m == 0:
        return out
    block_n = 16 if n <= 8192 else 32
    block_k = min(512, max(16, triton.next_power_of_2(k)))
    ieee = weight.dtype == torch.float32
    if ieee:
        block_k = min(block_k, 128)  # full-precision dots need more registers
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight if bias is None else bias, out, weight if norm is None else norm[0],
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), 0.0 if norm is None else norm[1],
        PRO=1 if norm is not None else 2 if gated else 0, HAS_BIAS=bias is not None,
        ADD_RES=residual is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee,
        num_warps=4, num_stages=4,
    )  # fmt: skip
    return out

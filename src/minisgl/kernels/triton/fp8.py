"""fp8 (e4m3) kernels for projections of many rows: dynamic activation quantization and a matmul
with block scales.

- `quant_rows`: x (M, K) -> fp8 (M, K) and float32 scales, one per row (M, 1) or per group of
  `group` columns (M, ceil(K / group)): each row's (group's) largest magnitude maps to 448. One
  program per (row, group). Per-row scales feed `torch._scaled_mm` (per-channel weights), per-group
  ones the block matmul below.
- `block_matmul`: y = (xq * xs) @ (wq * ws)^T for DeepSeek-style scales, x per (row, group of bk
  columns), W per (bn, bk) block: each K step of bk columns is one fp8 tensor-core dot whose float32
  result is scaled by its two scales (the accumulator stays float32). Grid over (BLOCK_M x BLOCK_N)
  output tiles, grouped along M so neighbouring programs share W tiles in L2.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import interpreting

FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)


if interpreting():
    # Triton's interpreter (3.9) rounds float32 -> e4m3 without carrying into the exponent (126.2
    # becomes 64, not 128): round here to a representable value, which it then converts exactly.
    @triton.jit
    def to_fp8(x):
        """float32 x, |x| <= 448 -> float8e4nv, rounded to nearest (ties away from zero)."""
        ax = tl.abs(x)
        e = tl.floor(tl.log2(tl.maximum(ax, 2.0**-9)))
        ulp = tl.exp2(tl.maximum(e, -6.0) - 3.0)  # 3 mantissa bits; subnormals below 2^-6
        r = tl.floor(ax / ulp + 0.5) * ulp
        return tl.where(x < 0, -r, r).to(tl.float8e4nv)

else:

    @triton.jit
    def to_fp8(x):
        """float32 x, |x| <= 448 -> float8e4nv (the hardware's round to nearest even)."""
        return x.to(tl.float8e4nv)


# `widen_fp8` returns bf16 values 2^-112 times the fp8 ones: its callers multiply this back in with
# their scales (exact: a power of two).
WIDEN = tl.constexpr(2.0**112)

if interpreting() or os.environ.get("MINISGL_FP8_WIDEN") == "convert":  # the latter: to compare

    @triton.jit
    def widen_fp8(w):
        """float8e4nv -> bfloat16 times 2^-112 (what the compiled version's bit trick computes, in
        plain conversions)."""
        return (w.to(tl.float32) * (1.0 / WIDEN)).to(tl.bfloat16)

else:

    @triton.jit
    def widen_fp8(w):
        """float8e4nv -> bfloat16 times 2^-112, exactly: e4m3 -> f16 pairs in one instruction each, then
        f16 -> bf16 by moving the exponent and mantissa bits down 3 places, sign kept (three integer
        instructions a pair). The direct conversion takes a pair through two f16 -> bf16 conversions, on
        the conversion pipe (16 a cycle per SM), which cannot keep up with HBM's fp8 bytes; these run on
        the integer pipe."""
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b16 lo, hi;
            .reg .b32 a, b, t;
            mov.b32 {lo, hi}, $2;
            cvt.rn.f16x2.e4m3x2 a, lo;
            cvt.rn.f16x2.e4m3x2 b, hi;
            shr.b32 t, a, 3;
            and.b32 t, t, 0x0FFF0FFF;
            lop3.b32 $0, a, 0x80008000, t, 0xea;
            shr.b32 t, b, 3;
            and.b32 t, t, 0x0FFF0FFF;
            lop3.b32 $1, b, 0x80008000, t, 0xea;
            }
            """,
            constraints="=r,=r,r",
            args=[w.to(tl.uint8, bitcast=True)],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )


@triton.jit
def quantize_fp8(x, scale):
    """x / scale rounded to float8e4nv, saturating at +-448 (an IEEE division, as the reference's)."""
    return to_fp8(tl.clamp(tl.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX))


@triton.jit
def _quant_rows_kernel(X, Q, S, k, stride_x, stride_q, stride_s, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (offs < k)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 0), FP8_MAX), MIN_SCALE)
    tl.store(Q + row * stride_q + offs, quantize_fp8(x, scale), mask=mask)
    tl.store(S + row * stride_s + g, scale)


def quant_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K), unit stride in K -> (fp8 (M, K), float32 scales (M, ceil(K / group))); group None:
    one scale per row, (M, 1)."""
    m, k = x.shape
    if x.stride(1) != 1:
        raise ValueError("quant_rows: x needs unit stride in K")
    group = k if group is None else group
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    block = triton.next_power_of_2(group)
    _quant_rows_kernel[(m, groups)](
        x, q, s, k, x.stride(0), q.stride(0), s.stride(0), GROUP=group, BLOCK=block,
        num_warps=max(1, min(16, block // 512)),
    )  # fmt: skip
    return q, s


@triton.jit
def _block_matmul_kernel(
    A,  # (M, K) fp8
    AS,  # (M, KB) float32: a scale per row and group of BLOCK_K columns
    B,  # (N, K) fp8
    BS,  # (NB, KB) float32: a scale per (SCALE_N, BLOCK_K) block of B
    C,  # (M, N) output
    Bias,  # (N,) or unused
    m,
    n,
    k,
    stride_am,
    stride_as,
    stride_bn,
    stride_bs,
    stride_cm,
    SCALE_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(m, BLOCK_M)
    grid_n = tl.cdiv(n, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    safe_m = offs_m % m  # rows past the end read row 0 again: no load masks
    safe_n = offs_n % n
    a_ptrs = A + safe_m[:, None] * stride_am + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    b_ptrs = B + safe_n[None, :] * stride_bn + offs_k[:, None]  # (BLOCK_K, BLOCK_N), K-major
    as_ptrs = AS + safe_m * stride_as  # (BLOCK_M,)
    bs_ptrs = BS + (safe_n // SCALE_N) * stride_bs  # (BLOCK_N,)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(k, BLOCK_K)):
        k_mask = offs_k < k - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        a_s = tl.load(as_ptrs + kb)
        b_s = tl.load(bs_ptrs + kb)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(Bias + safe_n).to(tl.float32)[None, :]
    c_ptrs = C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(offs_m < m)[:, None] & (offs_n < n)[None, :])


def block_matmul(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """xq (M, K) fp8 with scales xs (M, ceil(K / bk)) per row and group of bk columns, wq (N, K) fp8
    with scales ws (ceil(N / bn), ceil(K / bk)) -> (M, N) in out_dtype (+ bias)."""
    m, k = xq.shape
    n = wq.shape[0]
    bn, bk = block
    if (
        wq.shape[1] != k
        or xs.shape != (m, triton.cdiv(k, bk))
        or ws.shape != (triton.cdiv(n, bn), xs.shape[1])
    ):
        raise ValueError(
            f"block_matmul: x {tuple(xq.shape)} / {tuple(xs.shape)}, w {tuple(wq.shape)} / {tuple(ws.shape)}"
        )
    if bk < 32 or bk & (bk - 1) or xq.stride(1) != 1 or wq.stride(1) != 1:
        raise ValueError(f"block_matmul: block {block} needs a power-of-two column size >= 32, unit strides")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    block_n = min(128, bn)
    if bn % block_n or block_n & (block_n - 1) or block_n < 16:
        raise ValueError(f"block_matmul: block rows {bn} must be a multiple of a power of two >= 16")
    block_m = 64 if m <= 64 else 128
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _block_matmul_kernel[grid](
        xq, xs, wq, ws, out, ws if bias is None else bias, m, n, k,
        xq.stride(0), xs.stride(0), wq.stride(0), ws.stride(0), out.stride(0),
        SCALE_N=bn, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, GROUP_M=8,
        num_warps=4 if block_m == 64 else 8, num_stages=3,
    )  # fmt: skip
    return out

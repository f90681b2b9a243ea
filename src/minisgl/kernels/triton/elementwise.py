"""Element-wise kernels of a transformer layer: RMSNorm (over rows or per head), RoPE + q/k/v split
(with Qwen3's per-head q/k RMSNorm before it), SiLU x up; the norm and SiLU x up
also quantized per row to fp8 in the same kernel (`rmsnorm_fp8`, `silu_and_mul_fp8`: the fp8 matmul's
input). One program per token row (and head block); math in float32, one rounding to the
tensor's dtype at the end (the torch reference rounds after each op: results agree within bf16/fp16
tolerance, and to float32 rounding in float32)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fp8 import FP8_MAX, MIN_SCALE, quantize_fp8
from .pdl import pdl_enter, pdl_launch, use_pdl


@triton.jit
def _quant_row(y, S, idx, QUANT: tl.constexpr, dtype: tl.constexpr):
    """QUANT: y (a whole row, float32) as `fp8.quant_rows` quantizes it once rounded to `dtype` (its
    scale stored at S[idx]); else y as it is."""
    if QUANT:
        y = y.to(dtype).to(tl.float32)
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(y), 0), FP8_MAX), MIN_SCALE)
        tl.store(S + idx, scale)
        y = quantize_fp8(y, scale)
    return y  # one return: the compiler wants one type from every return of a function


@triton.jit
def _rmsnorm_kernel(
    X,  # (rows, heads, N) strided, unit stride in N
    W,  # (N,)
    Out,  # (rows, heads, N) contiguous
    S,  # QUANT: (rows * heads,) float32, each row's fp8 scale
    stride_xr,
    stride_xh,
    n,
    eps,
    HEADS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    QUANT: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + row * stride_xr + head * stride_xh + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    y = (x * rstd).to(X.dtype.element_ty).to(tl.float32)  # HF rounds the normed x to its dtype
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    y = _quant_row(w * y, S, row * HEADS + head, QUANT, X.dtype.element_ty)
    tl.store(Out + (row * HEADS + head) * n + offs, y.to(Out.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x (T, N) or (T, H, N) with unit stride in N -> rmsnorm(x) * weight, a new contiguous tensor
    (in `out_dtype`, default x's: the normed x is rounded to x's dtype first either way)."""
    n = x.shape[-1]
    if x.stride(-1) != 1 or x.dim() not in (2, 3):
        raise ValueError(f"rmsnorm: x {tuple(x.shape)} strides {x.stride()}: the last dim must be contiguous")
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # (T, H, N)
    rows, heads = x3.shape[0], x3.shape[1]
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(n)
    # Few warps: a row is a few KB, and a wide block spends its time in the cross-warp reduction.
    pdl = use_pdl(x)
    _rmsnorm_kernel[(rows, heads)](
        x3, weight, out, out, x3.stride(0), x3.stride(1), n, eps, HEADS=heads, BLOCK=block,
        num_warps=4 if block <= 8192 else 8, PDL=pdl, **pdl_launch(pdl),
    )  # fmt: skip
    return out


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`rmsnorm` of x (T, N) (unit stride in N) quantized per row in the same kernel: (fp8 (T, N),
    float32 scales (T, 1)), the same bits as `fp8.quant_rows(rmsnorm(x, weight, eps))`."""
    t, n = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"rmsnorm_fp8: x {tuple(x.shape)} strides {x.stride()}")
    out = torch.empty(t, n, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t:
        block = triton.next_power_of_2(n)
        pdl = use_pdl(x)
        _rmsnorm_kernel[(t, 1)](
            x, weight, out, scales, x.stride(0), 0, n, eps, HEADS=1, BLOCK=block, QUANT=True,
            num_warps=4 if block <= 8192 else 8, PDL=pdl, **pdl_launch(pdl),
        )  # fmt: skip
    return out, scales


@triton.jit
def _rope_qkv_kernel(
    QKV,  # (T, (HQ + 2 HKV) * D), unit stride in the last dim
    Cos,  # (T, D/2) strided rows
    Sin,
    Q,  # (T, HQ, D) contiguous
    K,  # (T, HKV, D)
    V,  # (T, HKV, D)
    QW,  # (D,) q's RMSNorm weight (QK_NORM), else unused
    KW,  # (D,) k's
    stride_qkv,
    stride_cs,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    QK_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # head index in [0, HQ + 2 HKV)
    j = tl.arange(0, BLOCK_HALF)
    hm = h < HQ + 2 * HKV
    jm = j < HALF
    m = hm[:, None] & jm[None, :]
    src = QKV + t * stride_qkv + h[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)  # (BLOCK_H, HALF) first halves
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)  # second halves
    cos = tl.load(Cos + t * stride_cs + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + t * stride_cs + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    rot = (h < HQ + HKV)[:, None]  # q and k heads rotate; v heads are copied
    if QK_NORM:  # Qwen3: RMSNorm over each q and k head first, rounded as the reference rounds it
        dt = Q.dtype.element_ty
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        is_q = (h < HQ)[:, None]
        qw1 = tl.load(QW + j, mask=jm, other=0.0).to(tl.float32)[None, :]  # each half's weights
        qw2 = tl.load(QW + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        kw1 = tl.load(KW + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        kw2 = tl.load(KW + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        n1 = tl.where(is_q, qw1, kw1) * (x1 * rstd).to(dt).to(tl.float32)  # weight * rounded normed x
        n2 = tl.where(is_q, qw2, kw2) * (x2 * rstd).to(dt).to(tl.float32)
        x1 = tl.where(rot, n1.to(dt).to(tl.float32), x1)
        x2 = tl.where(rot, n2.to(dt).to(tl.float32), x2)
    y1 = tl.where(rot, x1 * cos - x2 * sin, x1)
    y2 = tl.where(rot, x2 * cos + x1 * sin, x2)
    hq = tl.minimum(h, HQ - 1)  # clamped so every branch forms an in-range address
    hk = tl.minimum(tl.maximum(h - HQ, 0), HKV - 1)
    hv = tl.minimum(tl.maximum(h - HQ - HKV, 0), HKV - 1)
    q_dst = Q + (t * HQ + hq)[:, None] * (2 * HALF) + j[None, :]
    k_dst = K + (t * HKV + hk)[:, None] * (2 * HALF) + j[None, :]
    v_dst = V + (t * HKV + hv)[:, None] * (2 * HALF) + j[None, :]
    dst = tl.where((h < HQ)[:, None], q_dst, tl.where(rot, k_dst, v_dst))
    tl.store(dst, y1.to(Q.dtype.element_ty), mask=m)
    tl.store(dst + HALF, y2.to(Q.dtype.element_ty), mask=m)


def rope_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    hq: int,
    hkv: int,
    d: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv (T, (Hq + 2 Hkv) D), cos/sin (T, 1, D/2) or (T, D/2) -> q (T, Hq, D) and k (T, Hkv, D)
    rotated (HF's rotate-half), v (T, Hkv, D); all contiguous, written by one kernel. qk_norm: (q's
    weight (D,), k's weight (D,), eps): each q and k head RMSNormed before the rotation (Qwen3)."""
    t = qkv.shape[0]
    if qkv.stride(-1) != 1 or qkv.shape[1] != (hq + 2 * hkv) * d or d % 2:
        raise ValueError(f"rope_qkv: qkv {tuple(qkv.shape)} for {hq}+2x{hkv} heads of {d}")
    cos, sin = cos.reshape(t, d // 2), sin.reshape(t, d // 2)
    q = qkv.new_empty(t, hq, d)
    k = qkv.new_empty(t, hkv, d)
    v = qkv.new_empty(t, hkv, d)
    if t == 0:
        return q, k, v
    heads = hq + 2 * hkv
    block_half = triton.next_power_of_2(d // 2)
    block_h = max(1, min(triton.next_power_of_2(heads), 4096 // block_half))
    grid = (t, triton.cdiv(heads, block_h))
    qw, kw, eps = qk_norm if qk_norm is not None else (qkv, qkv, 0.0)
    pdl = use_pdl(qkv)
    _rope_qkv_kernel[grid](
        qkv, cos, sin, q, k, v, qw, kw, qkv.stride(0), cos.stride(0), eps,
        HQ=hq, HKV=hkv, HALF=d // 2, BLOCK_H=block_h, BLOCK_HALF=block_half, QK_NORM=qk_norm is not None,
        num_warps=4, PDL=pdl, **pdl_launch(pdl),
    )  # fmt: skip
    return q, k, v


@triton.jit
def _silu_mul_kernel(
    GateUp, Out, S, stride_in, inter, BLOCK: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr = False
):  # QUANT: a whole row a program, quantized (S: (T,) its scales)
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(GateUp + t * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GateUp + t * stride_in + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = _quant_row(g / (1.0 + tl.exp(-g)) * u, S, t, QUANT, GateUp.dtype.element_ty)
    tl.store(Out + t * inter + offs, y.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(T, 2I) laid out [gate | up], unit stride in the last dim -> silu(gate) * up, (T, I) contiguous
    (in `out_dtype`, default gate_up's)."""
    t, two_i = gate_up.shape
    if gate_up.stride(-1) != 1 or two_i % 2:
        raise ValueError(f"silu_and_mul: gate_up {tuple(gate_up.shape)} strides {gate_up.stride()}")
    inter = two_i // 2
    out = gate_up.new_empty(t, inter, dtype=out_dtype or gate_up.dtype)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    pdl = use_pdl(gate_up)
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up, out, out, gate_up.stride(0), inter, BLOCK=block, num_warps=4, PDL=pdl, **pdl_launch(pdl)
    )
    return out


@triton.jit
def _silu_mul_rounded(GateUp, t, stride_in, inter, offs, mask):
    """silu(gate) * up at columns `offs` of row t, rounded to GateUp's dtype (as `_quant_row` rounds
    it), in float32; masked columns are 0."""
    g = tl.load(GateUp + t * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GateUp + t * stride_in + inter + offs, mask=mask, other=0.0).to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * u).to(GateUp.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_mul_amax_kernel(GateUp, Amax, stride_in, inter, chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row t, chunk c): Amax[t, c] = max |silu(gate) * up| over the chunk's BLOCK columns."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    y = _silu_mul_rounded(GateUp, t, stride_in, inter, offs, offs < inter)
    tl.store(Amax + t * chunks + c, tl.max(tl.abs(y), 0))


@triton.jit
def _silu_mul_quant_kernel(
    GateUp,
    Amax,
    Out,
    S,
    stride_in,
    inter,
    chunks,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row t, chunk c): the row's scale from its chunks' maxima (Amax (T, chunks)), then the
    chunk's silu(gate) * up again (from L2), quantized; chunk 0 stores the scale."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cs = tl.arange(0, CHUNKS)
    amax = tl.max(tl.load(Amax + t * chunks + cs, mask=cs < chunks, other=0.0), 0)
    scale = tl.maximum(tl.div_rn(amax, FP8_MAX), MIN_SCALE)
    if c == 0:
        tl.store(S + t, scale)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    y = _silu_mul_rounded(GateUp, t, stride_in, inter, offs, mask)
    tl.store(Out + t * inter + offs, quantize_fp8(y, scale), mask=mask)


# A whole row a program (the one-pass kernel): its warps, 0 by the row's width (up to 16). On an H200 at
# I = 14,336 (`bench_fused_quant.py --silu`) 32 warps were faster: 4,096 rows 113.1 us against 119.0, 256
# rows 9.07 against 9.61, 32 rows 5.59 against 5.91; not yet run in the workload, so not the default.
# MINISGL_FP8_SILU_ROW_WARPS: for A/B and tuning.
SILU_ROW_WARPS = int(os.environ.get("MINISGL_FP8_SILU_ROW_WARPS", "0"))

# Up to this many rows (small decode batches) `silu_and_mul_fp8` spreads a row over SILU_SPLIT_BLOCK-column
# programs in two launches (the row's maxima, then the quantization), where one program a row leaves
# most SMs idle. H200, 8B's I = 14,336, CUDA graphs (`bench_fused_quant.py --silu`): 32 rows 5.94 us
# a program a row, 3.75 split in 2,048 columns; 64 rows 6.02 / 6.53; 256 rows 9.61 / 11.01.
# MINISGL_FP8_SILU_SPLIT_ROWS=0: one program a row (A/B).
SILU_SPLIT_MAX_ROWS = int(os.environ.get("MINISGL_FP8_SILU_SPLIT_ROWS", "48"))
SILU_SPLIT_BLOCK = 2048


def silu_and_mul_fp8(gate_up: torch.Tensor, split: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_and_mul` quantized per row: (fp8 (T, I), float32 scales (T, 1)), the same bits as
    `fp8.quant_rows(silu_and_mul(gate_up))`. split (default: T <= SILU_SPLIT_MAX_ROWS): each row over
    chunks of SILU_SPLIT_BLOCK columns in two kernels (each chunk's maximum, then the row's scale and
    the quantization, silu(gate) * up computed again); else one kernel, a whole row a program."""
    t, two_i = gate_up.shape
    if gate_up.stride(-1) != 1 or two_i % 2:
        raise ValueError(f"silu_and_mul_fp8: gate_up {tuple(gate_up.shape)} strides {gate_up.stride()}")
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scales = torch.empty(t, 1, dtype=torch.float32, device=gate_up.device)
    if t == 0:
        return out, scales
    pdl = use_pdl(gate_up)
    if split if split is not None else t <= SILU_SPLIT_MAX_ROWS:
        block = min(SILU_SPLIT_BLOCK, triton.next_power_of_2(inter))
        chunks = triton.cdiv(inter, block)
        amax = torch.empty(t, chunks, dtype=torch.float32, device=gate_up.device)
        warps = max(1, min(8, block // 256))
        _silu_mul_amax_kernel[(t, chunks)](
            gate_up, amax, gate_up.stride(0), inter, chunks, BLOCK=block, num_warps=warps, PDL=pdl,
            **pdl_launch(pdl),
        )  # fmt: skip
        _silu_mul_quant_kernel[(t, chunks)](
            gate_up, amax, out, scales, gate_up.stride(0), inter, chunks, BLOCK=block,
            CHUNKS=triton.next_power_of_2(chunks), num_warps=warps, PDL=pdl, **pdl_launch(pdl),
        )  # fmt: skip
        return out, scales
    block = triton.next_power_of_2(inter)
    warps = SILU_ROW_WARPS or max(4, min(16, block // 1024))
    _silu_mul_kernel[(t, 1)](
        gate_up, out, scales, gate_up.stride(0), inter, BLOCK=block, QUANT=True, num_warps=warps, PDL=pdl,
        **pdl_launch(pdl),
    )  # fmt: skip
    return out, scales

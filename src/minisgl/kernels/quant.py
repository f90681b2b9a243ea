"""Torch-facing wrappers of the quantized-weight kernels (`cpu_quant.c`): one ctypes call each.

`qlinear` is the projection of a `QuantizedWeight` (any mix of GGUF block formats and 16-bit or
32-bit float rows), optionally with the RMSNorm or SiLU x up that makes its input and the residual
add after it; `dequant_rows` is the embedding lookup. Inputs are contiguous float32 CPU tensors;
shapes are checked here."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from minisgl.quant import QuantizedWeight
from minisgl.utils.pages import release_pages

from . import graph
from .build import load_quant

PRE_NONE, PRE_RMSNORM, PRE_SILU_MUL = 0, 1, 2
PREFILL_MODES = ("int8", "bf16")


@functools.cache
def prefill_mode() -> str:
    """How prefill passes multiply: MINISGL_CPU_PREFILL=int8 (the default: the decode passes' int8
    kernel where the weight's rows are grouped, the fastest here) or bf16 (bfloat16 products where
    the CPU has them, AMX or AVX-512 BF16: closer to float32, ~1.2-1.3x the prefill time)."""
    mode = os.environ.get("MINISGL_CPU_PREFILL", "int8")
    if mode not in PREFILL_MODES:
        raise ValueError(f"MINISGL_CPU_PREFILL={mode!r}: choose from {', '.join(PREFILL_MODES)}")
    return mode


def _pass_kind(prefill: bool, bf16_prefill: bool | None) -> int:
    """cpu_quant.c's `prefill` argument: 0 a decode pass, 1 a prefill pass, 2 one in bf16 products."""
    if not prefill:
        return 0
    return 2 if (prefill_mode() == "bf16" if bf16_prefill is None else bf16_prefill) else 1


def quant_available(isa: str | None = None) -> bool:
    return load_quant(isa) is not None


def _lib(isa: str | None) -> ctypes.CDLL:
    lib = load_quant(isa)
    if lib is None:
        raise RuntimeError("the quantized CPU kernels are unavailable here: check quant_available() first")
    return lib


def _f32(t: torch.Tensor, name: str) -> int:
    if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous CPU float32 tensor, got {t.dtype} {t.device}")
    return t.data_ptr()


def qlinear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    prefill: bool = False,
    bf16_prefill: bool | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """x (M, K) @ W^T (+ bias) -> (M, N); with `norm` (weight (K,), eps) of rmsnorm(x); with
    `silu_mul` of silu(gate) * up, x (M, 2K) = [gate | up]; with `residual` (M, N) added into it in
    place (and returned). `prefill`: a prefill pass's (the amx kernels take AMX tiles then);
    `bf16_prefill`: its products in bf16 where the CPU has them (None: `prefill_mode()`'s)."""
    n, k = weight.shape
    m, width = x.shape
    if width != (2 * k if silu_mul else k) or (norm is not None and silu_mul):
        raise ValueError(f"qlinear: x {tuple(x.shape)} against a ({n}, {k}) weight")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"qlinear: bias {tuple(bias.shape)} for {n} outputs")
    if norm is not None and norm[0].shape != (k,):
        raise ValueError(f"qlinear: norm weight {tuple(norm[0].shape)} for {k} inputs")
    y = residual if residual is not None else graph.empty((m, n))
    if y.shape != (m, n):
        raise ValueError(f"qlinear: residual {tuple(y.shape)}, expected {(m, n)}")
    pre = PRE_RMSNORM if norm is not None else PRE_SILU_MUL if silu_mul else PRE_NONE
    nw = None if norm is None else norm[0]
    args = [
        _f32(x, "x"),
        m,
        k,
        width,
        pre,
        0 if nw is None else _f32(nw, "norm weight"),
        graph.float_bits(0.0 if norm is None else norm[1]),
        weight.row_ptrs.data_ptr(),
        weight.row_fmts.data_ptr(),
        n,
        0 if bias is None else _f32(bias, "bias"),
        _f32(y, "y"),
        n,
        int(residual is not None),
        _pass_kind(prefill, bf16_prefill),
    ]
    keep = [t for t in (x, nw, weight.row_ptrs, weight.row_fmts, bias, y) if t is not None]
    rc = graph.call(_lib(isa).minisgl_qlinear_packed, args, keep)
    if rc == -2:
        raise MemoryError("qlinear: out of scratch memory")
    if rc != 0:
        raise ValueError(f"qlinear: a weight row of an unknown type, or K = {k} not whole blocks")
    return y


def dequant_rows(weight: QuantizedWeight, ids: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """Rows `ids` (T,) int64 of the weight, dequantized -> (T, K) float32."""
    if ids.dtype is not torch.int64 or ids.dim() != 1 or not ids.is_contiguous():
        raise ValueError(f"dequant_rows: ids must be a contiguous 1-D int64 tensor, got {ids.dtype}")
    n, k = weight.shape
    out = graph.empty((ids.shape[0], k))
    args = [
        weight.row_ptrs.data_ptr(),
        weight.row_fmts.data_ptr(),
        n,
        ids.data_ptr(),
        ids.shape[0],
        k,
        out.data_ptr(),
    ]
    rc = graph.call(_lib(isa).minisgl_dequant_rows_packed, args, (weight.row_ptrs, weight.row_fmts, ids, out))
    if rc != 0:
        raise IndexError(f"dequant_rows: an id outside [0, {n})")
    return out


# Q4_0, Q4_1, Q8_0 and (grouped only) Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: the formats `repack` takes
# (cpu_quant.c, "repacked rows", "grouped rows")
_PACKABLE = {2, 3, 6, 7, 8, 12, 13, 14}


def repack_bytes(weight: QuantizedWeight, isa: str | None = None) -> int | None:
    """The bytes `repack` needs for `weight`'s rows; None where it cannot repack them (see there)."""
    lib = _lib(isa)
    if not lib.minisgl_repack_supported() or not {int(f) for f in weight.formats} <= _PACKABLE:
        return None
    n, k = weight.shape
    size = ctypes.c_int64(0)
    if lib.minisgl_repack_bytes(weight.row_fmts.data_ptr(), n, k, ctypes.byref(size)) != 0:
        return None
    return size.value


def repack(weight: QuantizedWeight, isa: str | None = None, out: torch.Tensor | None = None) -> bool:
    """Repack `weight`'s rows once for this build's decode kernel, which then sums each block's integer
    products in one lane (cpu_quant.c, "grouped rows": 16 rows interleaved on AVX-512; "repacked rows"
    otherwise): the same bytes reordered into a new buffer that the row table points at (`out`, uint8,
    64-byte aligned and at least `repack_bytes` long, when given), and the file pages of its parts
    released (the reference path re-reads them from the file). Returns whether it did: every row must
    be Q4_0, Q4_1 or Q8_0 (or, in whole groups of 16 rows on AVX-512, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K)
    and the build must have the kernel (AVX-512 or AVX2)."""
    if weight.packed is not None:
        return True
    size = repack_bytes(weight, isa)
    if size is None:
        return False
    if out is None:
        out = torch.empty(size, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.numel() < size or out.data_ptr() % 64:
        raise ValueError(f"repack: `out` must be 64-byte aligned uint8 of at least {size} bytes")
    lib, (n, k) = _lib(isa), weight.shape
    buf = out[:size]
    ptrs = torch.empty(n, dtype=torch.int64)
    fmts = torch.empty(n, dtype=torch.int32)
    rc = lib.minisgl_repack_rows(
        weight.row_ptrs.data_ptr(),
        weight.row_fmts.data_ptr(),
        n,
        k,
        buf.data_ptr(),
        ptrs.data_ptr(),
        fmts.data_ptr(),
    )
    if rc != 0:
        return False
    weight.use_packed(buf, ptrs, fmts)
    for part in weight.parts:
        if part.mapped:
            release_pages(part.data)
    return True

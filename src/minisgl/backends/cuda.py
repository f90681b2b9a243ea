"""The CUDA backend: Triton kernels for the element-wise work of a layer (RMSNorm, RoPE + q/k/v split,
SiLU x up) and for the routed experts of a mixture-of-experts layer (a fused MoE: two grouped GEMMs); the projections of a few rows (decode batches) in minisgl's Triton GEMV, the others in
cuBLAS with the residual add after a projection in the GEMM's epilogue (`addmm_`, beta = 1). In
bf16/fp16 the Triton kernels round once where the reference rounds after each op, and the epilogue
adds the unrounded product, so results agree within that dtype's tolerance.

A Triton matmul for decode batches with the norm and SiLU x up fused in as prologues lost to cuBLAS
(README, "GPU"): the GEMV takes only the residual add, as its epilogue.

One bf16/fp16 row (batch-1 decode) of qkv and o takes the same CUDA-core row GEMV unscaled, the
RMSNorm before qkv and the residual add after o fused (`bf16_row_config`; MINISGL_BF16_ROW=0: the
RMSNorm kernel and cuBLAS / the GEMV as before).

fp8 weights (`Fp8Weight`): one row with per-channel scales in the CUDA-core row GEMV
(`kernels.triton.gemv.row`), the RMSNorm before qkv and gate/up and SiLU x up after gate/up fused in
(`norm_linear`, `norm_mlp_add_`: two kernels for the MLP); up to 16 rows in the GEMV's fp8 variant (the weight widened in registers,
x not quantized); where the GEMV's input comes from minisgl's RMSNorm or SiLU x up kernel (qkv,
gate/up, down) those write it in fp16, to which the weight widens in one instruction a pair. More rows
quantize x per token (inside the RMSNorm or SiLU x up kernel before the projection where there is one,
`fused_quant`; else a Triton kernel of its own) and take, per-channel scales, minisgl's Triton fp8
matmul for decode batches (`skinny_config`: up to 256 rows where it beat cuBLASLt, the residual add in
its epilogue) or `torch._scaled_mm` (cuBLASLt's fp8 with row and column scales, fast accumulation,
`FAST_ACCUM`), the residual added after; block scales minisgl's Triton block-scaled fp8 matmul
(DeepSeek-style blocks)."""

from __future__ import annotations

import functools
import json
import os

import torch
import triton

from minisgl.kernels.triton import elementwise as tk
from minisgl.kernels.triton import fp8 as tf8
from minisgl.kernels.triton.fp8_skinny import SkinnyConfig, skinny_fp8_matmul
from minisgl.kernels.triton.gemv import GemvConfig, RowGemvConfig, gemv, gemv_fp8, gemv_fp8_rows
from minisgl.kernels.triton.moe import ROUTE_IN_ALIGN, route_topk, routed_moe, routed_moe_from_router
from minisgl.quant import QuantizedWeight

from .fp8 import Fp8Weight, Weight
from .torch_ops import QkNorm, TorchOps

GEMV_MAX_ROWS = 16  # decode batches of up to this many rows take the GEMV (one tensor-core tile)
GEMV_DTYPES = (torch.bfloat16, torch.float16)
FP8_ROW_GEMV_MAX_ROWS = 1  # decode batches of up to this many rows take the fp8 row GEMV
FP8_ROW_RESIDENT_K = 4096  # up to this K, one step of the row GEMV spans a row and x stays in registers


def gemv_config(x: torch.Tensor, weight: torch.Tensor) -> GemvConfig | None:
    """The GEMV's launch shape for this projection, or None where cuBLAS takes it.

    Measured on an H200 under CUDA graphs, weights streamed from HBM (`benchmarks/bench_linear.py
    --sweep`, README "GPU"): the GEMV wins where N <= 2K (qkv, o and down, where cuBLAS splits K or
    leaves SMs idle; o of Llama-3.1-8B 10.9 vs 13.5 us), cuBLAS holds its own where N is wide (gate/up,
    the LM head). The launch shapes are the sweep's best for the 8B and 135M shapes."""
    if x.dim() != 2 or x.shape[0] > GEMV_MAX_ROWS or x.dtype not in GEMV_DTYPES or weight.dtype != x.dtype:
        return None
    n, k = weight.shape
    if n > 2 * k or x.stride(1) != 1 or weight.stride(1) != 1:
        return None
    if n * k < 1 << 22:  # small projections: short rows, more programs
        return GemvConfig(16, 512, 4, 3) if k >= 1024 else GemvConfig(16, 128, 4, 6)
    return GemvConfig(32, 512, 4, 4) if k >= 8192 else GemvConfig(32, 256, 2, 4)


def fp8_gemv_config(x: torch.Tensor, weight: Fp8Weight) -> GemvConfig | None:
    """The fp8 GEMV's launch shape for this projection, or None where the fp8 matmul takes it (more
    than 16 rows). Every width takes the GEMV (a quantize kernel plus a matmul tuned for many rows
    would not stream the weight faster). Shapes: the best of `benchmarks/bench_fp8_linear.py --sweep`
    on an H200 for the 8B shapes (README, "fp8")."""
    if x.dim() != 2 or x.shape[0] > GEMV_MAX_ROWS or x.dtype not in (*GEMV_DTYPES, torch.float32):
        return None
    if x.stride(1) != 1 or weight.qweight.stride(1) != 1:
        return None
    n, k = weight.shape
    if weight.block is not None:  # a step of the loop is one block's columns
        return GemvConfig(64, weight.block[1], 4, 4)
    if n * k < 1 << 22:
        return GemvConfig(16, 512, 4, 3)
    if k >= 8192:  # down
        return GemvConfig(32, 1024, 4, 3)
    if n >= 4 * k:  # gate/up
        return GemvConfig(128, 256, 8, 3)
    return GemvConfig(64, 512, 4, 3) if n > k else GemvConfig(32, 512, 4, 4)  # qkv; o


def fp8_row_key(n: int, k: int, gated: bool) -> str:
    """A weight's key in MINISGL_FP8_ROW_CONFIGS: "NxK", "g" after it for a [gate | up] weight."""
    return f"{n}x{k}{'g' if gated else ''}"


@functools.cache
def _fp8_row_overrides() -> dict[str, RowGemvConfig]:
    """Launch shapes from the JSON file MINISGL_FP8_ROW_CONFIGS names ({key: [block_n, block_k,
    num_warps, iters, prefetch]}, as `benchmarks/bench_fp8_gemv_rows.py --json` writes it): for tuning."""
    path = os.environ.get("MINISGL_FP8_ROW_CONFIGS")
    if not path:
        return {}
    with open(path) as f:
        return {key: RowGemvConfig(*shape) for key, shape in json.load(f).items()}


def fp8_row_config(x: torch.Tensor, weight: Fp8Weight, gated: bool = False) -> RowGemvConfig | None:
    """The fp8 row GEMV's launch shape (CUDA cores, `kernels.triton.gemv.row`), or None where it does
    not take x: per-channel scales, at most FP8_ROW_GEMV_MAX_ROWS contiguous 16-bit rows. Shapes: the
    best of `benchmarks/bench_fp8_gemv_rows.py` on an H200 for the 8B shapes (docs/benchmarks.md, "fp8")."""
    if weight.block is not None or x.dim() != 2 or not 0 < x.shape[0] <= FP8_ROW_GEMV_MAX_ROWS:
        return None
    if x.dtype not in GEMV_DTYPES or not x.is_contiguous() or weight.qweight.stride(1) != 1:
        return None
    n, k = weight.shape
    if (override := _fp8_row_overrides().get(fp8_row_key(n, k, gated))) is not None:
        return override
    if gated:  # gate/up, BLOCK_N rows of each half: K in steps (one step over K, 34.1 us, lost)
        return RowGemvConfig(2, 1024, 2)
    if k > FP8_ROW_RESIDENT_K:  # down: K in steps, x read with each (one step of 16384, 21.5 us, lost)
        return RowGemvConfig(1, 1024, 2)
    kp = triton.next_power_of_2(k)  # qkv, o: one step over K, x loaded once, several blocks a program
    if n >= 8 * k:  # an fp8 LM head (`fp8_lm_head`; 8B: 126 us, 4.2 TB/s, against 157 in qkv's shape)
        return RowGemvConfig(1, kp, 4, 8)
    return RowGemvConfig(2, kp, 8, 8, True) if n > k else RowGemvConfig(2, kp, 4, 4, True)


def bf16_row_config(x: torch.Tensor, weight: object) -> RowGemvConfig | None:
    """One 16-bit row (batch-1 decode) of qkv (its RMSNorm fused) or o (its residual add fused) in the
    CUDA-core row GEMV, unscaled (`gemv_fp8_rows` with scale None), or None: K up to
    FP8_ROW_RESIDENT_K (one step over K, x in registers), N up to 4K (wider: cuBLAS or the GEMV as
    before). MINISGL_BF16_ROW=0 turns it off; MINISGL_FP8_ROW_CONFIGS' "NxKb" keys override the shape.
    Shapes: the fp8 row GEMV's for qkv, o over 8 warps (a bf16 row is twice an fp8 row's bytes)."""
    if os.environ.get("MINISGL_BF16_ROW", "1") in ("", "0") or type(weight) not in (
        torch.Tensor,
        torch.nn.Parameter,
    ):
        return None
    assert isinstance(weight, torch.Tensor)
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in GEMV_DTYPES or weight.dtype != x.dtype:
        return None
    n, k = weight.shape
    if not x.is_contiguous() or weight.stride(1) != 1 or k > FP8_ROW_RESIDENT_K or n > 4 * k:
        return None
    if (override := _fp8_row_overrides().get(f"{n}x{k}b")) is not None:
        return override
    # qkv 6.3 us, o 6.4 us on an H200 (bench_bf16_rows.py, Qwen3-30B-A3B shapes)
    kp = triton.next_power_of_2(k)
    return RowGemvConfig(2, kp, 8, 4, True) if n > k else RowGemvConfig(2, kp, 4, 4, True)


# The per-token quantization of x fused into the RMSNorm and SiLU x up before an fp8 matmul with
# per-channel scales (`rmsnorm_fp8`, `silu_and_mul_fp8`), at every row count: on an H200 at 8B's shapes
# the norm and the qkv matmul 38.5 us against 90.9 with the separate kernel at 256 rows, 176.3 against
# 206.7 at 4,096; SiLU x up and down 61.2 against 113.7, 511.8 against 568.8 (`benchmarks/
# bench_fused_quant.py`, eager). MINISGL_FP8_FUSED_QUANT=0: the quantization as its own kernel (A/B).
FUSED_QUANT = os.environ.get("MINISGL_FP8_FUSED_QUANT", "1") != "0"
# cuBLASLt's fp8 matmul without its periodic promotion of the running sum to float32 (`_scaled_mm`'s
# use_fast_accum; CUTLASS's "FP8FastAccum" schedules). On an H200 at 8B's shapes (`bench_fused_quant.py
# --accum`): gate/up 57.2 against 64.6 us at 256 rows, 749.2 against 839.5 at 4,096, qkv 165.1 against
# 180.2 at 4,096; the error against the exact product of the fp8 operands 2.1e-3 (K = 4,096) and 3.3e-3
# (K = 14,336) against 1.7e-3 (the bf16 output's rounding), where quantizing x and W to fp8 costs ~3.7%.
# In the throughput workload decode 8.89 -> 8.38 ms a step, prefill 2.32 -> 2.16 s.
# MINISGL_FP8_FAST_ACCUM=0: promoted (for A/B and accuracy checks).
FAST_ACCUM = os.environ.get("MINISGL_FP8_FAST_ACCUM", "1") not in ("", "0")


def fused_quant(x: torch.Tensor, weight: Weight) -> bool:
    """Whether x (the RMSNorm's or SiLU x up's input) goes to `fp8_matmul`'s per-channel path, so that
    the kernel before it can write x quantized (`rmsnorm_fp8`, `silu_and_mul_fp8`)."""
    if not FUSED_QUANT or not isinstance(weight, Fp8Weight) or weight.block is not None:
        return False
    n, k = weight.shape
    return x.dim() == 2 and x.shape[0] > GEMV_MAX_ROWS and x.dtype == torch.bfloat16 and x.stride(1) == 1 \
        and not n % 16 and not k % 16  # fmt: skip


def scaled_mm(xq: torch.Tensor, xs: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None,
              out_dtype: torch.dtype, fast_accum: bool | None = None) -> torch.Tensor:  # fmt: skip
    """fp8 x (M, K) with per-row scales xs (M, 1) @ W^T (per-channel scales) through cuBLASLt
    (fast_accum: `FAST_ACCUM` unless given)."""
    return torch._scaled_mm(
        xq, weight.qweight.t(), scale_a=xs, scale_b=weight.scale.view(1, -1), bias=bias, out_dtype=out_dtype,
        use_fast_accum=FAST_ACCUM if fast_accum is None else fast_accum,
    )  # fmt: skip


# fp8 W8A8 matmuls of decode batches (more rows than the GEMV takes, up to SKINNY_MAX_ROWS) in
# minisgl's Triton kernel (`kernels.triton.fp8_skinny`) where it beat cuBLASLt, whose 128 x 128 tiles
# leave most SMs idle on o and down. H200, 8B shapes, CUDA graphs, weights from HBM (`benchmarks/
# bench_fp8_skinny.py --sweep`; o and down with the residual add), cuBLASLt / skinny in us at 32, 128
# and 256 rows: o 14.8 / 7.6, 15.2 / 8.4, 15.6 / 11.1; down 38.0 / 21.2, 38.5 / 25.0, 40.2 / 33.1;
# qkv 13.4 / 8.8, 13.9 / 11.1, then cuBLASLt from 129 rows (14.2 / 15.3 at 256); gate/up 35.5 / 31.8
# at 32, cuBLASLt from 65 rows (37.3 / 40.2 at 128). Split-K never won. MINISGL_FP8_SKINNY=0:
# cuBLASLt at every size (A/B).
SKINNY = os.environ.get("MINISGL_FP8_SKINNY", "1") not in ("", "0")
SKINNY_MAX_ROWS = 256


def skinny_config(m: int, n: int, k: int) -> SkinnyConfig | None:
    """The skinny fp8 matmul's launch shape for an (m, k) @ (n, k)^T, or None where cuBLASLt takes it:
    x's rows on the tensor core's narrow side (swap), 64 rows of W and 256 columns a program step,
    the sweep's best by row count and projection kind (wide gate/up, qkv, and N <= K: o, down)."""
    if not SKINNY or not GEMV_MAX_ROWS < m <= SKINNY_MAX_ROWS:
        return None
    if n >= 4 * k:  # gate/up
        if m > 64:
            return None
        cfg = (
            SkinnyConfig(32, 64, 256, 1, 4, 4, True) if m <= 32 else SkinnyConfig(64, 128, 256, 1, 8, 4, True)
        )
    elif n > k:  # qkv
        if m > 128:
            return None
        cfg = SkinnyConfig(32 if m <= 32 else (64 if m <= 64 else 128), 64, 256, 1, 4, 4, True)
    elif m <= 32:  # o, down
        cfg = SkinnyConfig(32, 64, 256, 1, 4, 4, True)
    elif m <= 64:
        cfg = SkinnyConfig(64, 32, 256, 1, 4, 4, False)
    else:
        cfg = SkinnyConfig(64 if m <= 128 else 128, 64, 256, 1, 4, 4, True)
    if not cfg.fits(m, n, k):
        cfg = SkinnyConfig(cfg.block_m, cfg.block_n, 128, 1, cfg.num_warps, cfg.num_stages, cfg.swap)
    return cfg if cfg.fits(m, n, k) else None


def fp8_mm(xq: torch.Tensor, xs: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None,
           out_dtype: torch.dtype, residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`scaled_mm` (+ `residual` in place) through the skinny kernel where `skinny_config` gives a shape."""
    n, k = weight.shape
    cfg = skinny_config(xq.shape[0], n, k)
    fits = residual is None or (residual.shape == (xq.shape[0], n) and residual.is_contiguous())
    if cfg is not None and fits and xq.stride(1) == 1 and weight.scale.is_contiguous():
        return skinny_fp8_matmul(xq, xs, weight.qweight, weight.scale, bias, out_dtype, cfg, residual)
    y = scaled_mm(xq, xs, weight, bias, out_dtype)
    return y if residual is None else residual.add_(y)


def fp8_matmul(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None,
               residual: torch.Tensor | None = None) -> torch.Tensor | None:  # fmt: skip
    """x (M, K) @ W^T (+ bias) -> (M, N) in x's dtype with x quantized per token (per group of the
    block's columns for block scales), added into `residual` in place when given; None where neither
    fp8 matmul takes it (then: the reference)."""
    n, k = weight.shape
    if x.dtype != torch.bfloat16 or x.dim() != 2 or n % 16 or k % 16:
        return None
    if weight.block is not None and (weight.block[1] < 32 or weight.block[1] & (weight.block[1] - 1)):
        return None  # the fp8 tensor-core dot takes 32 columns at least
    if weight.block is None:
        xq, xs = tf8.quant_rows(x)  # (M, K) fp8, (M, 1)
        return fp8_mm(xq, xs, weight, bias, x.dtype, residual)
    xq, xs = tf8.quant_rows(x, weight.block[1])  # (M, K) fp8, (M, K / bk)
    y = tf8.block_matmul(xq, xs, weight.qweight, weight.scale, weight.block, bias, x.dtype)
    return y if residual is None else residual.add_(y)


class CudaOps(TorchOps):
    name = "cuda"

    def _fp8_linear(
        self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None, residual: torch.Tensor | None
    ) -> torch.Tensor:
        """`linear` (residual None) or `residual += linear` with an fp8 weight."""
        x2 = x.reshape(-1, x.shape[-1])  # (T, K)
        row = fp8_row_config(x2, weight)
        if row is not None and (residual is None or residual.is_contiguous()):
            y = gemv_fp8_rows(x2, weight.qweight, weight.scale, bias, residual, config=row)
            return y if residual is not None else y.view(*x.shape[:-1], -1)
        config = fp8_gemv_config(x2, weight)
        if config is not None and (residual is None or residual.is_contiguous()):
            y = gemv_fp8(x2, weight.qweight, weight.scale, weight.block, bias, residual, config)
            return y if residual is not None else y.view(*x.shape[:-1], -1)
        res2 = (
            residual.view(-1, residual.shape[-1])
            if residual is not None and residual.is_contiguous()
            else None
        )
        mm = fp8_matmul(x2, weight, bias, res2)
        if mm is not None and residual is not None and res2 is not None:
            return residual
        y = super().linear(x2, weight, bias) if mm is None else mm  # None: the reference, dequantized
        y = y.view(*x.shape[:-1], -1)
        return y if residual is None else residual.add_(y)

    def _fp16_gemv(self, x: torch.Tensor, weight: Weight) -> GemvConfig | None:
        """The fp8 GEMV's launch shape where x (bf16, from a kernel that can write fp16) goes to it."""
        if not isinstance(weight, Fp8Weight) or x.dtype != torch.bfloat16 or x.dim() != 2:
            return None
        return fp8_gemv_config(x, weight) if x.is_contiguous() else None

    def norm_linear(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: Weight,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        if isinstance(weight, Fp8Weight) and (row := fp8_row_config(x, weight)) is not None:
            return gemv_fp8_rows(x, weight.qweight, weight.scale, bias, None, (norm_weight, eps), config=row)
        if (row := bf16_row_config(x, weight)) is not None:
            assert isinstance(weight, torch.Tensor)
            return gemv_fp8_rows(x, weight, None, bias, None, (norm_weight, eps), config=row)
        if fused_quant(x, weight) and norm_weight.shape == x.shape[1:]:
            assert isinstance(weight, Fp8Weight)
            return fp8_mm(*tk.rmsnorm_fp8(x, norm_weight, eps), weight, bias, x.dtype)
        config = self._fp16_gemv(x, weight)
        if config is None:
            return super().norm_linear(x, norm_weight, eps, weight, bias)
        assert isinstance(weight, Fp8Weight)
        h = tk.rmsnorm(x, norm_weight, eps, out_dtype=torch.float16)  # (T, K)
        return gemv_fp8(h, weight.qweight, weight.scale, weight.block, bias, None, config, out_dtype=x.dtype)

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, Fp8Weight):
            return self._fp8_linear(x, weight, bias, None)
        if not isinstance(weight, torch.Tensor) or (config := gemv_config(x, weight)) is None:
            return super().linear(x, weight, bias)  # cuBLAS; a GGUF block weight: the reference
        return gemv(x, weight, bias, config=config)

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() in (2, 3) and x.stride(-1) == 1:
            return tk.rmsnorm(x, weight, eps)
        return super().rmsnorm(x, weight, eps)

    def linear_add_(
        self,
        x: torch.Tensor,
        weight: Weight,
        bias: torch.Tensor | None,
        residual: torch.Tensor,
        gated: bool = False,
    ) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):  # a CPU checkpoint format: the reference
            return super().linear_add_(x, weight, bias, residual, gated)
        config = self._fp16_gemv(x, weight) if gated and residual.is_contiguous() else None
        if config is not None:
            assert isinstance(weight, Fp8Weight)
            if fp8_row_config(x, weight) is None:  # else the row GEMV below, after SiLU x up
                h = tk.silu_and_mul(x, out_dtype=torch.float16)  # (T, I)
                return gemv_fp8(h, weight.qweight, weight.scale, weight.block, bias, residual, config)
        if gated and fused_quant(x, weight):
            assert isinstance(weight, Fp8Weight)
            return fp8_mm(*tk.silu_and_mul_fp8(x), weight, bias, x.dtype, residual)
        if gated:
            x = self.silu_and_mul(x)
        if isinstance(weight, Fp8Weight):
            return self._fp8_linear(x, weight, bias, residual)
        if residual.is_contiguous() and (row := bf16_row_config(x, weight)) is not None:
            return gemv_fp8_rows(x, weight, None, bias, residual, config=row)
        config = gemv_config(x, weight)
        if config is not None and residual.is_contiguous():
            return gemv(x, weight, bias, residual, config)
        residual.addmm_(x, weight.t())  # one cuBLAS call: the add is the GEMM's epilogue (beta = 1)
        return residual if bias is None else residual.add_(bias)

    def norm_mlp_add_(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gate_up: Weight,
        down: Weight,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """fp8 weights in the row GEMV: two kernels, the norm and SiLU x up fused into the gate/up one."""
        if (
            isinstance(gate_up, Fp8Weight)
            and isinstance(down, Fp8Weight)
            and residual.is_contiguous()
            and (row_gu := fp8_row_config(x, gate_up, gated=True)) is not None
            and (row_down := fp8_row_config(x, down)) is not None
        ):
            h = gemv_fp8_rows(x, gate_up.qweight, gate_up.scale, None, None, (norm_weight, eps), True, row_gu)
            return gemv_fp8_rows(h, down.qweight, down.scale, None, residual, config=row_down)  # (T, I) in
        return super().norm_mlp_add_(x, norm_weight, eps, gate_up, down, residual)

    def rope_qkv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        hq: int,
        hkv: int,
        d: int,
        qk_norm: QkNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One kernel, Qwen3's q/k norms included (they were four more a layer)."""
        if qkv.dim() == 2 and qkv.stride(-1) == 1 and d % 2 == 0:
            return tk.rope_qkv(qkv, cos, sin, hq, hkv, d, qk_norm)
        return super().rope_qkv(qkv, cos, sin, hq, hkv, d, qk_norm)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return tk.silu_and_mul(gate_up)
        return super().silu_and_mul(gate_up)

    def moe(
        self,
        x: torch.Tensor,
        router: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The fused Triton MoE: at decode sizes the router's logits, the routing and the alignment in
        one kernel (more tokens: the logits through the GEMV or cuBLAS, then the routing kernel), the
        k-sum and the residual add inside its down GEMM (`kernels.triton.moe`); no host sync."""
        if x.dim() != 2 or x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
            return super().moe(x, router, w13, w2, top_k, renormalize, residual)
        if residual is not None and not residual.is_contiguous():
            return residual.add_(self.moe(x, router, w13, w2, top_k, renormalize))
        return self.routed_experts(x, router, w13, w2, top_k, renormalize, residual)[0]

    def norm_moe_(
        self,
        h: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        router: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
    ) -> torch.Tensor:
        """A decode batch's RMSNorm inside the router's launch (`routed_moe_from_router` with `norm`):
        one kernel fewer a layer, the normed x the same bits as `rmsnorm`'s."""
        if (
            h.dim() == 2
            and h.is_contiguous()
            and w13.stride(2) == 1
            and w2.stride(2) == 1
            and self._router_in_one_launch(h, router)
            and norm_weight.shape == (h.shape[1],)
            and norm_weight.is_contiguous()
        ):
            self.routed_experts(h, router, w13, w2, top_k, renormalize, h, (norm_weight, eps))
            return h
        return super().norm_moe_(h, norm_weight, eps, router, w13, w2, top_k, renormalize)

    @staticmethod
    def _router_in_one_launch(x: torch.Tensor, router: torch.Tensor) -> bool:
        """Whether a batch's router logits, routing and alignment take one launch (decode sizes)."""
        return (
            0 < x.shape[0] <= ROUTE_IN_ALIGN
            and type(router) in (torch.Tensor, torch.nn.Parameter)
            and router.dtype == x.dtype
            and router.stride(1) == 1
        )

    def routed_experts(
        self,
        x: torch.Tensor,
        router: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
        residual: torch.Tensor | None,
        norm: tuple[torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`moe`'s fast path -> (its output, the experts it chose (T, K)), x (T, H) contiguous. A decode
        batch's router logits, routing and alignment are one launch (`routed_moe_from_router`).
        norm (weight, eps): x is the residual stream, the experts take its RMSNorm (at decode sizes
        computed in that launch)."""
        if self._router_in_one_launch(x, router):
            return routed_moe_from_router(x, router, w13, w2, top_k, renormalize, residual, norm)
        if norm is not None:
            x = self.rmsnorm(x, *norm)
        return routed_moe(x, self.linear(x, router, None), w13, w2, top_k, renormalize, residual)

    def route(
        self, x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits in x's dtype (as transformers computes them), then softmax, top-k and the
        renormalization in one kernel; exact ties go to the lower expert index (`route_topk`)."""
        if x.dim() != 2:
            return super().route(x, router, top_k, renormalize)
        return route_topk(self.linear(x, router, None), top_k, renormalize)

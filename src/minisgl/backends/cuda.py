"""The CUDA backend: Triton kernels for the element-wise work of a layer (RMSNorm, RoPE + q/k/v split,
SiLU x up) and cuBLAS for the matmuls, with the residual add after a projection in the GEMM's
epilogue (`addmm_`, beta = 1). In bf16/fp16 the Triton kernels round once where the reference rounds
after each op, and the epilogue adds the unrounded product, so results agree within that dtype's
tolerance.

Decode steps of a few rows over large weights take minisgl's skinny matmul instead
(`minisgl.kernels.triton.skinny`), with the RMSNorm before the projection, or the SiLU x up before
it and the residual add after it, fused in: two kernels fewer per layer (Llama-3.1-8B's MLP). It
streams a weight as fast as cuBLAS only when the weight is large (a 4096 x 4096 projection is up to
2x slower than cuBLAS on an H200), hence `skinny_min_weight`; `MINISGL_SKINNY_MIN_WEIGHT` (elements)
overrides it for measurements."""

from __future__ import annotations

import os

import torch

from minisgl.kernels.triton import elementwise as tk
from minisgl.kernels.triton.skinny import skinny_linear

from .torch_ops import TorchOps


class CudaOps(TorchOps):
    name = "cuda"

    skinny_max_rows = 8  # matmuls of up to this many rows may take the skinny kernel ...
    skinny_min_weight = int(
        os.environ.get("MINISGL_SKINNY_MIN_WEIGHT", 1 << 25)
    )  # ... over this many weights

    def _skinny(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and x.shape[0] <= self.skinny_max_rows
            and weight.numel() >= self.skinny_min_weight
            and x.stride(1) == 1
            and weight.stride(1) == 1
        )

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() in (2, 3) and x.stride(-1) == 1:
            return tk.rmsnorm(x, weight, eps)
        return super().rmsnorm(x, weight, eps)

    def norm_linear(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        if self._skinny(x, weight):
            return skinny_linear(x, weight, bias, norm=(norm_weight, eps))
        return super().norm_linear(x, norm_weight, eps, weight, bias)

    def linear_add_(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor,
        gated: bool = False,
    ) -> torch.Tensor:
        if self._skinny(x, weight) and residual.is_contiguous():
            return skinny_linear(x, weight, bias, gated=gated, residual=residual)
        if gated:
            x = self.silu_and_mul(x)
        residual.addmm_(x, weight.t())  # one cuBLAS call: the add is the GEMM's epilogue (beta = 1)
        return residual if bias is None else residual.add_(bias)

    def rope_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if qkv.dim() == 2 and qkv.stride(-1) == 1 and d % 2 == 0:
            return tk.rope_qkv(qkv, cos, sin, hq, hkv, d)
        return super().rope_qkv(qkv, cos, sin, hq, hkv, d)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return tk.silu_and_mul(gate_up)
        return super().silu_and_mul(gate_up)

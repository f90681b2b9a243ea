"""The CUDA backend: Triton kernels for the element-wise work of a layer (RMSNorm, RoPE + q/k/v split,
SiLU x up) and cuBLAS for the matmuls, with the residual add after a projection in the GEMM's
epilogue (`addmm_`, beta = 1). In bf16/fp16 the Triton kernels round once where the reference rounds
after each op, and the epilogue adds the unrounded product, so results agree within that dtype's
tolerance.

A hand-written Triton matmul for decode batches, with the norm, SiLU x up and residual add fused in,
lost to cuBLAS on an H200 with Llama-3.1-8B shapes (README, "GPU"): cuBLAS keeps every matmul."""

from __future__ import annotations

import torch

from minisgl.kernels.triton import elementwise as tk

from .torch_ops import TorchOps


class CudaOps(TorchOps):
    name = "cuda"

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() in (2, 3) and x.stride(-1) == 1:
            return tk.rmsnorm(x, weight, eps)
        return super().rmsnorm(x, weight, eps)

    def linear_add_(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor,
        gated: bool = False,
    ) -> torch.Tensor:
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

"""The CUDA backend: fused Triton kernels for the element-wise work of a layer (residual add + RMSNorm,
RoPE + q/k/v split, SiLU x up), cuBLAS (`F.linear`) for the matmuls. In bf16/fp16 the fused kernels
round once where the reference rounds after each op, so results agree within that dtype's tolerance."""

from __future__ import annotations

import torch

from minisgl.kernels.triton import elementwise as tk

from .torch_ops import TorchOps


class CudaOps(TorchOps):
    name = "cuda"

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() in (2, 3) and x.stride(-1) == 1:
            return tk.add_rmsnorm(x, None, weight, eps)
        return super().rmsnorm(x, weight, eps)

    def add_rmsnorm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if h.dim() == 2 and h.is_contiguous() and (delta is None or delta.is_contiguous()):
            return tk.add_rmsnorm(h, delta, weight, eps)
        return super().add_rmsnorm(h, delta, weight, eps)

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

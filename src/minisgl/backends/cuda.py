"""The CUDA backend: Triton kernels for the element-wise work of a layer (RMSNorm, RoPE + q/k/v split,
SiLU x up) and for the routed experts of a mixture-of-experts layer (a fused MoE: two grouped GEMMs); the projections of a few rows (decode batches) in minisgl's Triton GEMV, the others in
cuBLAS with the residual add after a projection in the GEMM's epilogue (`addmm_`, beta = 1). In
bf16/fp16 the Triton kernels round once where the reference rounds after each op, and the epilogue
adds the unrounded product, so results agree within that dtype's tolerance.

A Triton matmul for decode batches with the norm and SiLU x up fused in as prologues lost to cuBLAS
(README, "GPU"): the GEMV takes only the residual add, as its epilogue."""

from __future__ import annotations

import torch

from minisgl.kernels.triton import elementwise as tk
from minisgl.kernels.triton.gemv import GemvConfig, gemv
from minisgl.kernels.triton.moe import fused_moe

from .torch_ops import TorchOps, Weight

GEMV_MAX_ROWS = 16  # decode batches of up to this many rows take the GEMV (one tensor-core tile)
GEMV_DTYPES = (torch.bfloat16, torch.float16)


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


class CudaOps(TorchOps):
    name = "cuda"

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        config = gemv_config(x, weight) if isinstance(weight, torch.Tensor) else None
        if config is None or not isinstance(weight, torch.Tensor):
            return super().linear(x, weight, bias)
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
        if not isinstance(weight, torch.Tensor):  # a CPU checkpoint format: the reference
            return super().linear_add_(x, weight, bias, residual, gated)
        if gated:
            x = self.silu_and_mul(x)
        config = gemv_config(x, weight)
        if config is not None and residual.is_contiguous():
            return gemv(x, weight, bias, residual, config)
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

    def moe(
        self,
        x: torch.Tensor,
        router: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
    ) -> torch.Tensor:
        """Routing in torch (its topk breaks ties as transformers does), the experts in the fused
        Triton MoE, which also renormalizes the weights in its epilogue; no host sync."""
        if x.dim() != 2 or x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
            return super().moe(x, router, w13, w2, top_k, renormalize)
        weights, ids = self.route(x, router, top_k, renormalize=False)
        return fused_moe(x, w13, w2, weights, ids, renormalize)

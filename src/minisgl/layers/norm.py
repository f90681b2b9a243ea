"""RMSNorm, computed exactly like Hugging Face's Llama/Qwen RMSNorm so greedy decoding stays token-identical."""

from __future__ import annotations

import torch
from torch import nn

from minisgl import kernels


class RMSNorm(nn.Module):
    """`weight * (x * rsqrt(mean(x^2) + eps))`, the statistics in float32, the product in x's dtype."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., size) -> (..., size)
        in_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(in_dtype)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """`h += delta` in place (a residual add; skipped when delta is None), then `self(h)`: one pass
        through the CPU kernel when it applies (float32 (T, H) rows), else two torch steps."""
        if h.dim() == 2 and kernels.fits(h, self.weight, *(() if delta is None else (delta,))):
            return kernels.add_rmsnorm(h, delta, self.weight, self.eps)
        if delta is not None:
            h.add_(delta)
        return self(h)

"""RMSNorm, computed exactly like Hugging Face's Llama/Qwen RMSNorm so greedy decoding stays token-identical."""

from __future__ import annotations

import torch
from torch import nn


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

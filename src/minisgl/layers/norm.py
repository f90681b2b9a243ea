"""RMSNorm, computed exactly like Hugging Face's Llama/Qwen RMSNorm by the reference ops (so greedy
decoding stays token-identical); faster backends fuse it with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.backends import OpsUser


class RMSNorm(nn.Module, OpsUser):
    """`weight * (x * rsqrt(mean(x^2) + eps))`, the statistics in float32, the product in x's dtype."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., size) -> (..., size)
        return self.ops.rmsnorm(x, self.weight, self.eps)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """`h += delta` in place (a residual add; skipped when delta is None), then `self(h)`."""
        return self.ops.add_rmsnorm(h, delta, self.weight, self.eps)

"""RMSNorm, computed exactly like Hugging Face's Llama/Qwen RMSNorm by the reference ops (so greedy
decoding stays token-identical); the norm before a projection goes through `Linear.forward_normed`,
which a backend may fuse."""

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

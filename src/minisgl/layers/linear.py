"""Linear layers whose parameters are allocated uninitialised (weights come from the loader).

Column-parallel layers need nothing special: they are plain `Linear`s of the local output width.
`RowParallelLinear` sums the partial products of the ranks (its input is this rank's slice). The
matmul itself is the ops backend's (`minisgl.backends`): F.linear, prepacked CPU kernels or cuBLAS.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.backends import OpsUser
from minisgl.distributed import DistributedInfo
from minisgl.layers.norm import RMSNorm
from minisgl.layers.tp import all_reduce


class Linear(nn.Module, OpsUser):
    """y = x W^T (+ b), W (out, in) allocated empty: no random init on load."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        return self.ops.linear(x, self.weight, self.bias)

    def forward_normed(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """This projection of `norm(x)`, (T, in) -> (T, out) (a backend may fuse the two)."""
        return self.ops.norm_linear(x, norm.weight, norm.eps, self.weight, self.bias)


class RowParallelLinear(Linear):
    """Input features split over ranks; the outputs are all-reduced, then the (whole) bias is added once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: DistributedInfo,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in / N) -> (T, out)
        if self.tp.size == 1:
            return self.ops.linear(x, self.weight, self.bias)
        y = all_reduce(self.ops.linear(x, self.weight, None), self.tp)
        return y if self.bias is None else y + self.bias

    def forward_add_(self, x: torch.Tensor, residual: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """`residual += self(x)` in place (with `gated`: x is a gate/up pair, the input silu(gate) * up).
        One rank: the backend may fuse the add (and the gating) into the matmul; several: the partial
        products are all-reduced first."""
        if self.tp.size == 1:
            return self.ops.linear_add_(x, self.weight, self.bias, residual, gated)
        return residual.add_(self(self.ops.silu_and_mul(x) if gated else x))

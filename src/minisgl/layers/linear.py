"""Linear layers whose parameters are allocated uninitialised (weights come from the loader).

Column-parallel layers need nothing special: they are plain `Linear`s of the local output width.
`RowParallelLinear` sums the partial products of the ranks (its input is this rank's slice). The
matmul itself is the ops backend's (`minisgl.backends`): F.linear, prepacked CPU kernels or cuBLAS.

A quantized checkpoint (or `--quantization fp8`) turns a layer to fp8 before loading (`to_fp8`): its
`weight` becomes the (out, in) float8_e4m3fn parameter, `weight_scale` its scales, and the ops
receive both as one `Fp8Weight` (`w`): the same call, whatever the weight's kind.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.backends import OpsUser
from minisgl.backends.fp8 import FP8, Fp8Weight
from minisgl.distributed import DistributedInfo
from minisgl.layers.norm import RMSNorm
from minisgl.layers.tp import all_reduce


class Linear(nn.Module, OpsUser):
    """y = x W^T (+ b), W (out, in) allocated empty: no random init on load."""

    fp8: Fp8Weight | None = None  # set by `to_fp8`

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

    @property
    def w(self) -> torch.Tensor | Fp8Weight:
        """The weight as the ops take it: the parameter, or the fp8 weight with its scales."""
        return self.weight if self.fp8 is None else self.fp8

    def to_fp8(self, block: tuple[int, int] | None) -> None:
        """Hold the weight in fp8 (uninitialised, filled by the loader): `weight` (out, in)
        float8_e4m3fn, `weight_scale` float32 per output channel (out,) or per `block` (rows, cols)."""
        n, k = self.weight.shape
        device = self.weight.device
        shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
        self.weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.ones(shape, dtype=torch.float32, device=device), requires_grad=False
        )
        self.fp8 = Fp8Weight(self.weight, self.weight_scale, block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        return self.ops.linear(x, self.w, self.bias)

    def forward_normed(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """This projection of `norm(x)`, (T, in) -> (T, out) (a backend may fuse the two)."""
        return self.ops.norm_linear(x, norm.weight, norm.eps, self.w, self.bias)


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
            return self.ops.linear(x, self.w, self.bias)
        y = all_reduce(self.ops.linear(x, self.w, None), self.tp)
        return y if self.bias is None else y + self.bias

    def forward_add_(self, x: torch.Tensor, residual: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """`residual += self(x)` in place (with `gated`: x is a gate/up pair, the input silu(gate) * up).
        One rank: the backend may fuse the add (and the gating) into the matmul; several: the partial
        products are all-reduced first."""
        if self.tp.size == 1:
            return self.ops.linear_add_(x, self.w, self.bias, residual, gated)
        return residual.add_(self(self.ops.silu_and_mul(x) if gated else x))

    def forward_swiglu_add_(
        self, gate_up: Linear, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor
    ) -> torch.Tensor:
        """`residual += self(silu(gate) * up)`, [gate | up] = gate_up(norm(x)): the MLP of a decoder
        layer. One rank and no biases: one op, which a backend may fuse (the gating into the gate/up
        projection); else `forward_add_`."""
        if self.tp.size > 1 or self.bias is not None or gate_up.bias is not None:
            return self.forward_add_(gate_up.forward_normed(x, norm), residual, gated=True)
        return self.ops.norm_mlp_add_(x, norm.weight, norm.eps, gate_up.w, self.w, residual)

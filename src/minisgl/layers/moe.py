"""A mixture-of-experts block in place of the dense MLP: a router picks each token's top-k experts,
the backend's `moe` op runs them (`minisgl.backends`), and Qwen2-MoE adds a shared expert.

Every expert's gate/up rows are stacked into one (E, 2I, H) parameter and its down projection into
(E, H, I), so one op call covers every expert. Under tensor parallelism each rank holds its slice of
every expert's intermediate dimension (I / N rows of gate and of up, I / N columns of down) and the
whole router: the ranks route alike, each computes partial sums of every token's experts, and one
all-reduce per layer adds them, as in the dense MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.backends import OpsUser
from minisgl.distributed import DistributedInfo
from minisgl.layers.linear import Linear
from minisgl.layers.norm import RMSNorm
from minisgl.layers.tp import all_reduce


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class SharedExpert(nn.Module, OpsUser):
    """Qwen2-MoE's expert that every token goes through: a SwiGLU MLP scaled by sigmoid(gate x).
    Its down projection is left as this rank's partial sums (the block all-reduces once)."""

    def __init__(
        self, hidden: int, inter: int, tp: DistributedInfo, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        local = inter // tp.size
        self.gate_up_proj = Linear(hidden, 2 * local, False, dtype, device)
        self.down_proj = Linear(local, hidden, False, dtype, device)
        self.gate = Linear(hidden, 1, False, dtype, device)  # replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) normed -> (T, H) partial sums
        y = self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        return torch.sigmoid(self.gate(x)) * y


class SparseMoE(nn.Module, OpsUser):
    """`h += experts(norm(h))` in place: routed experts (and a shared one when `shared_inter` > 0)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        inter: int,
        top_k: int,
        renormalize: bool,
        shared_inter: int,
        tp: DistributedInfo,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        local = inter // tp.size
        self.tp, self.top_k, self.renormalize = tp, top_k, renormalize
        self.router = _empty(num_experts, hidden, dtype=dtype, device=device)  # (E, H)
        self.w13 = _empty(num_experts, 2 * local, hidden, dtype=dtype, device=device)  # [gate | up]
        self.w2 = _empty(num_experts, hidden, local, dtype=dtype, device=device)  # (E, H, I / N)
        self.shared = SharedExpert(hidden, shared_inter, tp, dtype, device) if shared_inter else None

    def forward(self, h: torch.Tensor, norm: RMSNorm) -> None:
        """h (T, H), the residual stream, updated in place (by the op itself where nothing else is
        added: one rank, no shared expert)."""
        if self.shared is None and self.tp.size == 1:  # the backend may fuse the norm in (CUDA: decode)
            self.ops.norm_moe_(
                h, norm.weight, norm.eps, self.router, self.w13, self.w2, self.top_k, self.renormalize
            )
            return
        x = norm(h)  # (T, H)
        y = self.ops.moe(x, self.router, self.w13, self.w2, self.top_k, self.renormalize)  # (T, H)
        if self.shared is not None:
            y += self.shared(x)
        h.add_(all_reduce(y, self.tp))

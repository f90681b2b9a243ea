"""SwiGLU gating over a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl import kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) laid out [gate | up] -> silu(gate) * up, (T, I). Overwrites the gate half of `gate_up`
    (the projection's own output, used once): one (T, I) temporary fewer, the same arithmetic."""
    if gate_up.dim() == 2 and kernels.fits(gate_up):
        return kernels.silu_mul(gate_up)  # one pass, no temporaries (CPU float32)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.mul(F.silu(gate, inplace=True), up)

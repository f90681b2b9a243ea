"""Tensor-parallel collectives over torch.distributed's default group (no-ops for one rank)."""

from __future__ import annotations

import torch

from minisgl.distributed import DistributedInfo


def all_reduce(x: torch.Tensor, tp: DistributedInfo) -> torch.Tensor:
    """Sum x over the ranks, in place (a no-op for one rank)."""
    if tp.size > 1:
        torch.distributed.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: DistributedInfo) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension (each rank holds an equal-width slice)."""
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)

"""Tensor-parallel helpers. `tp_info` is duck-typed (`.rank`, `.size`) so this module does not import
`minisgl.distributed` at import time; collectives use torch.distributed's default group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPInfo:
    """This rank's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1


def as_tp_info(tp_info: Any | None) -> TPInfo:
    """Normalise any object with `.rank` and `.size` (or None: a single rank) to a TPInfo."""
    if tp_info is None:
        return TPInfo()
    rank, size = int(tp_info.rank), int(tp_info.size)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad tensor-parallel info: rank {rank}, size {size}")
    return TPInfo(rank, size)


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Sum x over the ranks, in place (a no-op for one rank)."""
    if tp.size > 1:
        torch.distributed.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension (each rank holds an equal-width slice)."""
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)

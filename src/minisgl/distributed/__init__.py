"""Tensor-parallel identity and process groups.

`DistributedInfo(rank, size)` says which rank this process is. `init_process_groups` joins
torch.distributed and returns the gloo group the scheduler uses for control (message counts); tensor
collectives use the default group (NCCL between GPUs, gloo on the CPU). One rank needs neither.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DistributedInfo", "destroy_process_groups", "init_process_groups"]


@dataclass(frozen=True)
class DistributedInfo:
    """This process's place in the tensor-parallel group: rank in [0, size)."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1):
            raise ValueError(f"tensor-parallel size must be an int >= 1, got {self.size!r}")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.size):
            raise ValueError(f"rank must be an int in [0, {self.size}), got {self.rank!r}")

    def is_primary(self) -> bool:
        """Rank 0: the one that talks to the tokenizer and the detokenizer."""
        return self.rank == 0


def init_process_groups(
    tp_info: DistributedInfo, init_addr: str, backend: str = "gloo", timeout_s: float = 120.0
) -> ProcessGroup | None:
    """Join the tensor-parallel group at `init_addr` ("tcp://host:port"); return the gloo CPU group.

    backend="gloo": one group serves both tensors and control. backend="nccl": the default group is
    NCCL and a separate gloo group carries control messages, so a small CPU broadcast never queues
    behind GPU work. With one rank nothing is initialised: returns None.
    """
    if tp_info.size == 1:
        return None
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not init_addr.startswith("tcp://"):
        raise ValueError(f"init_addr must look like tcp://host:port, got {init_addr!r}")
    import torch.distributed as dist

    dist.init_process_group(
        backend=backend,
        init_method=init_addr,
        rank=tp_info.rank,
        world_size=tp_info.size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def destroy_process_groups() -> None:
    """Leave torch.distributed if it was joined (safe to call always)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

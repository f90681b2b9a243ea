"""Tensor-parallel identity and process groups.

`DistributedInfo(rank, size)` says which rank this process is. `init_process_groups` joins
torch.distributed and returns the gloo group the scheduler uses for control (message counts); with
NCCL it also keeps the device group for tensors (`get_device_group()`). One rank needs neither.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DistributedInfo",
    "destroy_process_groups",
    "find_free_port",
    "get_device_group",
    "get_tp_info",
    "init_process_groups",
    "set_tp_info",
]


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


_TP_INFO: DistributedInfo | None = None
_DEVICE_GROUP: Any = None


def set_tp_info(info: DistributedInfo) -> None:
    global _TP_INFO
    _TP_INFO = info


def get_tp_info() -> DistributedInfo:
    """The rank set by `set_tp_info` / `init_process_groups` (one rank of one if none was set)."""
    return _TP_INFO if _TP_INFO is not None else DistributedInfo(0, 1)


def get_device_group() -> Any:
    """The group for tensor collectives (NCCL on GPUs, gloo on the CPU); None with one rank."""
    return _DEVICE_GROUP


def init_process_groups(
    tp_info: DistributedInfo, init_addr: str, backend: str = "gloo", timeout_s: float = 120.0
) -> Any:
    """Join the tensor-parallel group at `init_addr` ("tcp://host:port"); return the gloo CPU group.

    backend="gloo": one group serves both tensors and control. backend="nccl": the default group is
    NCCL (kept as the device group) and a separate gloo group carries control messages, so a small
    CPU broadcast never queues behind GPU work. With one rank nothing is initialised: returns None.
    """
    global _DEVICE_GROUP
    set_tp_info(tp_info)
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
    _DEVICE_GROUP = dist.group.WORLD
    if backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def destroy_process_groups() -> None:
    """Leave torch.distributed if it was joined (safe to call always)."""
    global _DEVICE_GROUP
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _DEVICE_GROUP = None


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (for `tcp://127.0.0.1:PORT` rendezvous in tests and examples)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]

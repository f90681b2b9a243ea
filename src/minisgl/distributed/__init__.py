"""Tensor-parallel identity and process groups.

`DistributedInfo(rank, size)` says which rank this process is. `init_process_groups` joins
torch.distributed and returns the gloo group the scheduler uses for control (message counts); tensor
collectives use the default group (NCCL between GPUs, gloo on the CPU). One rank needs neither.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed import ProcessGroup

__all__ = [
    "DistributedInfo",
    "HostedStore",
    "destroy_process_groups",
    "host_store",
    "init_process_groups",
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


def init_process_groups(
    tp_info: DistributedInfo,
    init_addr: str,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    store_prefix: str | None = None,
) -> ProcessGroup | None:
    """Join the tensor-parallel group at `init_addr` ("tcp://host:port"); return the gloo CPU group.

    backend="gloo": one group serves both tensors and control. backend="nccl": the default group is
    NCCL and a separate gloo group carries control messages, so a small CPU broadcast never queues
    behind GPU work. With one rank nothing is initialised: returns None.

    store_prefix None: rank 0 hosts the rendezvous store at `init_addr`. Otherwise the store there is
    hosted by someone else (the launcher, see `host_store`) and this group's keys live under the prefix,
    so several groups (data-parallel replicas) share one store and one port.
    """
    if tp_info.size == 1:
        return None
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not init_addr.startswith("tcp://"):
        raise ValueError(f"init_addr must look like tcp://host:port, got {init_addr!r}")
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if store_prefix is None:
        rendezvous: dict = {"init_method": init_addr}
    else:
        host, port = _host_port(init_addr)
        client = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        rendezvous = {"store": dist.PrefixStore(store_prefix, client)}
    dist.init_process_group(
        backend=backend, rank=tp_info.rank, world_size=tp_info.size, timeout=timeout, **rendezvous
    )
    if backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


@dataclass
class HostedStore:
    """A torch.distributed store server and the listening socket it serves on (kept open here: the
    store does not own it). `close()` stops listening."""

    store: dist.TCPStore
    sock: socket.socket

    def close(self) -> None:
        self.sock.close()


def host_store(host: str, port: int, timeout_s: float = 120.0) -> HostedStore:
    """A torch.distributed store server listening on `host`:`port` only (TCPStore alone would listen
    on every interface): the launcher hosts it, the ranks join with `store_prefix`."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        store = dist.TCPStore(
            host,
            port,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    return HostedStore(store, sock)


def _host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def destroy_process_groups() -> None:
    """Leave torch.distributed if it was joined (safe to call always)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

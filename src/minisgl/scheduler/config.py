"""SchedulerConfig: what one scheduler rank needs to know, and where its sockets are.

Frozen: build a new config (`dataclasses.replace`) rather than changing one. Every process of one
server builds its configs with the same `_unique_suffix`, so they all derive the same addresses in
the same private directory (see `minisgl.utils.ipc`); two servers get different suffixes and so
different directories. The launcher calls `remove_ipc_dir()` once the server has stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from minisgl.distributed import DistributedInfo
from minisgl.engine.options import EngineOptions
from minisgl.kvcache import CACHE_TYPES
from minisgl.utils.ipc import ensure_private_dir, ipc_addr, ipc_dir_for, new_suffix, remove_ipc_dir
from minisgl.utils.options import option

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SchedulerConfig(EngineOptions):
    """The engine's options (inherited) plus the scheduler's own fields."""

    # Required here, unlike in EngineOptions (`field()`: a bare annotation would inherit the default).
    model_path: str = field()
    tp_info: DistributedInfo = field()
    dtype: str | torch.dtype = field()
    max_prefill_tokens: int = option(
        4096, "prompt tokens per prefill step at most: a step is what an abort or a new request may wait for"
    )
    overlap_schedule: bool | None = option(
        None, "launch step N+1 before taking step N's tokens", unset="on a GPU, off on the CPU"
    )
    cache_type: str = option(
        "radix",
        "prefix cache: radix reuses the KV of cached prompt prefixes (shared system prompts, chat "
        "history); naive prefills every prompt whole",
        choices=CACHE_TYPES,
    )
    offline_mode: bool = False  # the offline LLM class: no sockets, the subclass does the IO
    dist_init_addr: str = ""  # tcp://host:port for torch.distributed when tp_info.size > 1
    # Non-empty: the torch.distributed store at dist_init_addr is hosted by the launcher (one store
    # for every replica and node); this rank joins it as a client under this key prefix.
    dist_store_prefix: str = ""
    replica: int = 0  # which data-parallel replica (--dp) this rank belongs to: its own pipes
    report_load: bool = False  # rank 0 sends a LoadMsg whenever its running/waiting counts change
    device_index: int = 0  # the GPU this rank uses on its machine (cuda only)
    progress_slot: int = -1  # this rank's slot on the launcher's progress board (-1: none)
    # Several machines (--nnodes): rank 0's input also connects to these tcp endpoints (bound by the
    # tokenizers on node 0), its replies go to this tcp endpoint (bound by the detokenizer there), and
    # a tensor-parallel group that spans machines forwards its messages over tcp, not ipc.
    backend_tcp_addrs: tuple[str, ...] = ()
    detokenizer_tcp_addr: str = ""
    broadcast_over_tcp: bool = False
    _unique_suffix: str = field(default_factory=new_suffix)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.dist_init_addr and not self.dist_init_addr.startswith("tcp://"):
            raise ValueError(f"dist_init_addr must look like tcp://host:port, got {self.dist_init_addr!r}")
        if not (isinstance(self.replica, int) and self.replica >= 0):
            raise ValueError(f"replica must be an int >= 0, got {self.replica!r}")
        if not (isinstance(self.device_index, int) and self.device_index >= 0):
            raise ValueError(f"device_index must be an int >= 0, got {self.device_index!r}")
        ipc_dir_for(self._unique_suffix)  # a bad suffix fails here, not at the first socket

    # -- addresses -------------------------------------------------------------------------------
    @property
    def ipc_dir(self) -> Path:
        """This server's private socket directory (created 0700 on first use)."""
        return ensure_private_dir(ipc_dir_for(self._unique_suffix))

    def ipc_addr(self, name: str) -> str:
        """Any further socket of this server, e.g. `config.ipc_addr("frontend")`."""
        return ipc_addr(self.ipc_dir, name)

    def _replica_addr(self, name: str) -> str:
        """Replica 0 keeps the plain names; replica r > 0 appends r (its own pipes)."""
        return self.ipc_addr(name if self.replica == 0 else f"{name}{self.replica}")

    @property
    def zmq_backend_addr(self) -> str:
        """tokenizer -> scheduler rank 0 (rank 0 binds a PULL)."""
        return self._replica_addr("backend")

    @property
    def zmq_detokenizer_addr(self) -> str:
        """scheduler rank 0 -> detokenizer."""
        return self.detokenizer_tcp_addr or self._replica_addr("detokenizer")

    @property
    def zmq_scheduler_broadcast_addr(self) -> str:
        """scheduler rank 0 -> ranks 1..N-1 (XPUB/SUB)."""
        return self._replica_addr("broadcast")

    @property
    def zmq_frontend_addr(self) -> str:
        """detokenizer -> API server."""
        return self.ipc_addr("frontend")

    @property
    def zmq_tokenizer_addr(self) -> str:
        """API server -> tokenizer."""
        return self.ipc_addr("tokenizer")

    @property
    def backend_create_detokenizer_link(self) -> bool:
        """True: the scheduler binds the detokenizer link (the detokenizer connects); False on another
        machine than the detokenizer, which then binds a tcp endpoint on node 0."""
        return not self.detokenizer_tcp_addr

    def remove_ipc_dir(self) -> None:
        """Delete the socket directory (call once the whole server has stopped)."""
        remove_ipc_dir(ipc_dir_for(self._unique_suffix))

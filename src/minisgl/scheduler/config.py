"""SchedulerConfig: what one scheduler rank needs to know, and where its sockets are.

Frozen: build a new config (`dataclasses.replace`) rather than changing one. Every process of one
server builds its configs with the same `_unique_suffix`, so they all derive the same addresses in
the same private directory (see `minisgl.utils.ipc`); two servers get different suffixes and so
different directories. The launcher calls `remove_ipc_dir()` once the server has stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from minisgl.distributed import DistributedInfo
from minisgl.engine.options import EngineOptions
from minisgl.kvcache import CACHE_TYPES
from minisgl.utils.ipc import ensure_private_dir, ipc_addr, ipc_dir_for, new_suffix, remove_ipc_dir


@dataclass(frozen=True)
class SchedulerConfig(EngineOptions):
    """The engine's options (inherited) plus the scheduler's own fields."""

    # Required here, unlike in EngineOptions (`field()`: a bare annotation would inherit the default).
    model_path: str = field()
    tp_info: DistributedInfo = field()
    dtype: torch.dtype = field()
    max_prefill_tokens: int = 4096
    overlap_schedule: bool | None = None  # launch step N+1 before waiting for step N; None: on a GPU
    cache_type: str = "radix"  # prefix cache: "radix" shares cached prefixes; "naive" caches nothing
    offline_mode: bool = False  # the offline LLM class: no sockets, the subclass does the IO
    dist_init_addr: str = ""  # tcp://host:port for torch.distributed when tp_info.size > 1
    _unique_suffix: str = field(default_factory=new_suffix)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.cache_type not in CACHE_TYPES:
            raise ValueError(f"cache_type must be one of {CACHE_TYPES}, got {self.cache_type!r}")
        if self.dist_init_addr and not self.dist_init_addr.startswith("tcp://"):
            raise ValueError(f"dist_init_addr must look like tcp://host:port, got {self.dist_init_addr!r}")
        ipc_dir_for(self._unique_suffix)  # a bad suffix fails here, not at the first socket

    # -- addresses -------------------------------------------------------------------------------
    @property
    def ipc_dir(self) -> Path:
        """This server's private socket directory (created 0700 on first use)."""
        return ensure_private_dir(ipc_dir_for(self._unique_suffix))

    def ipc_addr(self, name: str) -> str:
        """Any further socket of this server, e.g. `config.ipc_addr("frontend")`."""
        return ipc_addr(self.ipc_dir, name)

    @property
    def zmq_backend_addr(self) -> str:
        """tokenizer -> scheduler rank 0 (rank 0 binds a PULL)."""
        return self.ipc_addr("backend")

    @property
    def zmq_detokenizer_addr(self) -> str:
        """scheduler rank 0 -> detokenizer."""
        return self.ipc_addr("detokenizer")

    @property
    def zmq_scheduler_broadcast_addr(self) -> str:
        """scheduler rank 0 -> ranks 1..N-1 (XPUB/SUB)."""
        return self.ipc_addr("broadcast")

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
        """True: the scheduler binds the detokenizer link (the detokenizer connects)."""
        return True

    def remove_ipc_dir(self) -> None:
        """Delete the socket directory (call once the whole server has stopped)."""
        remove_ipc_dir(ipc_dir_for(self._unique_suffix))

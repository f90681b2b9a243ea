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
from minisgl.kvcache import CACHE_TYPES
from minisgl.utils.ipc import ensure_private_dir, ipc_addr, ipc_dir_for, new_suffix, remove_ipc_dir

ENGINES = ("model", "dummy")


@dataclass(frozen=True)
class SchedulerConfig:
    model_path: str
    tp_info: DistributedInfo
    dtype: torch.dtype
    device: str = "cpu"
    engine: str = "model"  # "model": load the weights; "dummy": no model (tests, IO demos)
    dummy_weights: bool = False  # random weights of the model's shape (no weight files read)
    dummy_step_ms: float = 0.0  # the dummy engine sleeps this long per step (a model's step time)
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # KV pool size; None: from kv_cache_memory or gpu_memory_fraction
    kv_cache_memory: int | None = None  # bytes for the KV pool
    gpu_memory_fraction: float = 0.85
    max_running_requests: int = 256
    max_prefill_tokens: int = 4096
    max_seq_len: int | None = None  # None: the model's context length
    seed: int = 42
    attention_backend: str = "auto"  # auto | torch | cpu | triton (minisgl.attention)
    cuda_graph_max_bs: int = 256  # decode batches up to this size replay CUDA graphs; 0: none
    overlap_schedule: bool | None = None  # launch step N+1 before waiting for step N; None: on a GPU
    cache_type: str = "radix"  # prefix cache: "radix" shares cached prefixes; "naive" caches nothing
    offline_mode: bool = False  # the offline LLM class: no sockets, the subclass does the IO
    dist_init_addr: str = ""  # tcp://host:port for torch.distributed when tp_info.size > 1
    _unique_suffix: str = field(default_factory=new_suffix)

    def __post_init__(self) -> None:
        if not isinstance(self.tp_info, DistributedInfo):
            raise TypeError(f"tp_info must be a DistributedInfo, got {type(self.tp_info).__name__}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.cache_type not in CACHE_TYPES:
            raise ValueError(f"cache_type must be one of {CACHE_TYPES}, got {self.cache_type!r}")
        for name in ("page_size", "max_running_requests", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_pages", "kv_cache_memory", "max_seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0, got {self.cuda_graph_max_bs}")
        if not 0.0 <= self.dummy_step_ms <= 60_000.0:
            raise ValueError(f"dummy_step_ms must be in [0, 60000], got {self.dummy_step_ms}")
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


def cleanup_ipc(config: SchedulerConfig) -> None:
    """Function form of `config.remove_ipc_dir()`."""
    config.remove_ipc_dir()

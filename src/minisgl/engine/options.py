"""The engine's own knobs (a subset of SchedulerConfig, so tests can build an engine without one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class EngineOptions:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory: int | None = None  # bytes
    gpu_memory_fraction: float = 0.85
    max_running_requests: int = 256
    max_seq_len: int | None = None
    seed: int = 42
    attention_backend: str = "auto"  # see minisgl.attention.ATTENTION_BACKENDS
    ops_backend: str = "auto"  # see minisgl.backends.BACKENDS
    cuda_graph_max_bs: int = 256  # decode batches up to this size replay CUDA graphs (0: none)

    @classmethod
    def from_config(cls, config: Any) -> EngineOptions:
        """Pick the engine's fields out of a SchedulerConfig (duck-typed: missing fields keep defaults)."""
        names = [f for f in cls.__dataclass_fields__ if hasattr(config, f)]
        return cls(**{n: getattr(config, n) for n in names})

    def validate(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be a positive byte count, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0, got {self.cuda_graph_max_bs}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")

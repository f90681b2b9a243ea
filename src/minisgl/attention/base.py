"""The attention backend interface.

The engine calls `prepare(AttnInput)` once per batch (build gather indices, masks, kernel metadata);
every attention layer then calls `forward(q, k, v, layer_id)`, which stores the new K/V into the
paged pool and attends over each request's cached prefix plus its new tokens. One module per backend:
`torch_backend` (the reference), `cpu_backend` (C kernels), `triton_backend` (CUDA, paged kernels).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from minisgl.core import AttentionBackendProto
from minisgl.kvcache import KVPool


@dataclass
class AttnInput:
    """What a backend needs to know about one batch (built by the engine from the scheduler's lists)."""

    seq_lens: list[int]  # per request: tokens in the cache once this pass has stored its new ones
    extend_lens: list[int]  # per request: new tokens in this pass (1 per request when decoding)
    out_slots: torch.Tensor  # (T,) int64 on the CPU: pool slot of each new token
    page_rows: torch.Tensor  # (B, P) int32 on the CPU: the batch's page-table rows
    is_decode: bool
    row_ids: list[int] | None = None  # the requests' page-table row numbers (identify the batch)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)


class AttentionBackend(AttentionBackendProto, ABC):
    name = "base"
    # Whether decode steps can be captured in a CUDA graph: `prepare` then only rewrites buffers
    # whose addresses never change, and `forward` launches the same kernels for the same batch size.
    supports_cuda_graph = False

    def __init__(
        self,
        pool: KVPool,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | None = None,
    ) -> None:
        """dtype: the activations' (q, k, v), when the pool keeps K/V in another (a float16 pool for
        float32 activations on the CPU); None: the pool's."""
        if num_q_heads % num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        self.pool = pool
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.device = pool.k[0].device
        self.dtype = dtype or pool.value_dtype

    @abstractmethod
    def prepare(self, inp: AttnInput) -> None:
        """Build per-batch metadata once; `forward` reuses it in every layer."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q: (T, Hq, D), k/v: (T, Hkv, D) of the batch's new tokens -> (T, Hq, D)."""

"""minisgl.attention: attention backends behind one interface (`torch` now; `triton` later)."""

from __future__ import annotations

from .base import AttentionBackend, AttnInput
from .torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttnInput", "TorchAttentionBackend", "create_attention_backend"]


def create_attention_backend(
    name: str,
    pool,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,  # noqa: ANN001
) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend(pool, num_q_heads, num_kv_heads, head_dim)
    raise ValueError(f"unknown attention backend {name!r} (available: 'torch')")

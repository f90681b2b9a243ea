"""The attention call site: hands q/k/v to the forward context's backend (which owns the KV cache)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minisgl.core import get_global_ctx


class AttentionLayer(nn.Module):
    """One layer's slot in the paged KV cache; the model never sees the cache itself."""

    # (2, local KV heads) float32: K's and V's fp8 KV-cache scales from the checkpoint, None without
    # (read by the engine when it builds an fp8 KV pool)
    kv_scale: torch.Tensor | None = None

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D)."""
        return get_global_ctx().attn_backend.forward(q, k, v, self.layer_id)

    def forward_rope(
        self,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """qkv (T, (Hq + 2 Hkv) D) before RoPE -> (T, Hq, D); `split` rotates and splits it (after
        Qwen3's per-head norms, `qk_norm`, when given) unless the backend's kernel does that itself."""
        return get_global_ctx().attn_backend.forward_rope(qkv, rope, split, self.layer_id, qk_norm)

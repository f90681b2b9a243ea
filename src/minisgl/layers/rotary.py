"""Rotary position embedding with a precomputed cos/sin table indexed by each token's position.

The table holds half a head (HF's `cat(freqs, freqs)` repeats it), and the rotation is written
element by element as HF's `q * cos + rotate_half(q) * sin` so float32 results match it bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from minisgl.backends import OpsUser


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) in float32, with the supported `rope_scaling` types applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module, OpsUser):
    """Applies RoPE (rotate-half convention, HF weight layout) to q and k given token positions."""

    cos: torch.Tensor  # (P, D/2), registered buffers
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)  # (D/2,)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq[None, :]  # (P, D/2) float32, as HF's outer product
        self.register_buffer("cos", freqs.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype=dtype, device=device), persistent=False)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> (cos, sin), each (T, 1, D/2): gathered once per forward, used by every layer."""
        return self.ops.rope_lookup(self.cos, self.sin, positions)

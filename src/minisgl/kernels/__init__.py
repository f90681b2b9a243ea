"""minisgl.kernels: hand-written CPU kernels (C, built at first use) for the memory-bound parts of a
forward pass. Everything here has a plain-torch fallback in its caller; see build.py."""

from __future__ import annotations

from .build import load
from .ops import (
    add_rmsnorm,
    available,
    decode_attention,
    fits,
    pack_weight,
    packed_matmul,
    prefill_attention,
    rope_split,
    silu_mul,
)

__all__ = [
    "add_rmsnorm",
    "available",
    "decode_attention",
    "fits",
    "load",
    "pack_weight",
    "packed_matmul",
    "prefill_attention",
    "rope_split",
    "silu_mul",
]

"""minisgl.kernels: hand-written CPU kernels (C, built at first use) for the memory-bound parts of a
forward pass. Everything here has a plain-torch fallback in its caller; see build.py. Also which
kernels run on a device (`device_kernels`, `check_device`): the ops and attention backends' rule."""

from __future__ import annotations

import torch

from .build import load
from .ops import (
    MOE_MAX_K,
    add_rmsnorm,
    argmax_rows,
    available,
    decode_attention,
    extend_attention,
    fits,
    gather_rows,
    moe,
    pack_weight,
    packed_matmul,
    prefill_attention,
    rope_split,
    rope_store,
    silu_mul,
)
from .triton import interpreting, triton_available

__all__ = [
    "MOE_MAX_K",
    "add_rmsnorm",
    "argmax_rows",
    "available",
    "check_device",
    "decode_attention",
    "device_kernels",
    "extend_attention",
    "fits",
    "gather_rows",
    "load",
    "moe",
    "pack_weight",
    "packed_matmul",
    "prefill_attention",
    "rope_split",
    "rope_store",
    "silu_mul",
]


def device_kernels(device: torch.device) -> str:
    """The fastest of minisgl's kernels on `device`, what `auto` picks for the ops and the attention:
    "cpu" (the C kernels), "triton" (CUDA with Triton installed) or "torch" (none: plain torch)."""
    if device.type == "cpu":
        return "cpu"
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def check_device(kernels: str, device: torch.device, backend: str) -> None:
    """ValueError if `backend`, built on the `kernels` ("cpu", "triton"), cannot run on `device`.
    Triton's interpreter runs its kernels on CPU tensors (the tests)."""
    if kernels == "cpu" and device.type != "cpu":
        raise ValueError(f"the {backend} runs on the CPU, not on {device}")
    if kernels == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(f"the {backend} runs on a CUDA device, not on {device}")

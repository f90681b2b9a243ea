"""minisgl.attention: attention backends behind one interface, one module each: `torch` (the
reference, any device), `cpu` (C kernels), `triton` (CUDA: paged Triton kernels, CUDA graphs).

Only the backends' names load with the package (the configs check them without torch); the rest
loads on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from .base import AttentionBackend, AttnInput
    from .cpu_backend import CpuAttentionBackend
    from .create import create_attention_backend, resolve_attention_backend
    from .torch_backend import TorchAttentionBackend

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttnInput",
    "CpuAttentionBackend",
    "TorchAttentionBackend",
    "create_attention_backend",
    "resolve_attention_backend",
]

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")

__getattr__ = lazy_exports(
    __name__,
    {
        "AttentionBackend": ".base",
        "AttnInput": ".base",
        "CpuAttentionBackend": ".cpu_backend",
        "TorchAttentionBackend": ".torch_backend",
        "create_attention_backend": ".create",
        "resolve_attention_backend": ".create",
    },
)

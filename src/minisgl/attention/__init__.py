"""minisgl.attention: attention backends behind one interface, one module each: `torch` (the
reference, any device), `cpu` (C kernels), `triton` (CUDA: paged Triton kernels, CUDA graphs)."""

from __future__ import annotations

import torch

from minisgl.kernels import check_device, device_kernels
from minisgl.kvcache import KVPool

from .base import AttentionBackend, AttnInput
from .cpu_backend import CpuAttentionBackend
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


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """`auto` -> the fastest backend available on `device`; other names are checked and kept."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (choose from {', '.join(ATTENTION_BACKENDS)})")
    if name == "auto":
        return device_kernels(device)  # each backend is named after its kernels
    if name != "torch":
        check_device(name, device, f"{name} attention backend")
    return name


def create_attention_backend(
    name: str,
    pool: KVPool,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_batch_size: int,
    max_pages_per_row: int,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """dtype: the activations', when the pool's differs (see AttentionBackend)."""
    device = pool.k[0].device
    if pool.quantized and name == "auto" and device_kernels(device) == "cpu":
        name = "torch"  # the C kernels read float16 and float32 pools, not fp8
    name = resolve_attention_backend(name, device)
    if pool.quantized and name == "cpu":
        raise ValueError("an fp8 KV cache needs the triton or the torch attention backend, not cpu")
    if name == "torch":
        return TorchAttentionBackend(pool, num_q_heads, num_kv_heads, head_dim, dtype)
    if name == "cpu":
        return CpuAttentionBackend(
            pool, num_q_heads, num_kv_heads, head_dim, dtype, max_batch_size, max_pages_per_row
        )
    from .triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(
        pool, num_q_heads, num_kv_heads, head_dim, max_batch_size, max_pages_per_row
    )

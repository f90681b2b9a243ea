"""minisgl.backends: the ops a model calls (linear, norm with residual, rotary, activation), one
backend per device, chosen once when the engine is built.

- `torch` (`TorchOps`): the readable reference in plain torch, any device; every other backend is
  tested against it. Layers use it until an engine binds another.
- `cpu` (`CpuOps`): minisgl's C kernels (`minisgl.kernels`) and prepacked float32 weights.
- `cuda` (`CudaOps`): fused Triton kernels (`minisgl.kernels.triton`); cuBLAS for the matmuls.

`bind_ops(model, ops)` hands the chosen backend to every layer of a model: a transform applied once,
so layer code has no device or kernel branches.
"""

from __future__ import annotations

import torch
from torch import nn

from .torch_ops import REFERENCE_OPS, OpsUser, TorchOps

__all__ = ["BACKENDS", "REFERENCE_OPS", "OpsUser", "TorchOps", "bind_ops", "create_ops"]

BACKENDS = ("auto", "torch", "cpu", "cuda")


def create_ops(name: str, device: torch.device | str) -> TorchOps:
    """The ops backend `name` for this device; `auto` picks the fastest one available."""
    device = torch.device(device)
    if name == "auto":
        name = _auto(device)
    if name == "torch":
        return TorchOps()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the cpu ops backend runs on the CPU, not on {device}")
        from .cpu import CpuOps

        return CpuOps()
    if name == "cuda":
        from minisgl.kernels.triton import interpreting

        if device.type != "cuda" and not interpreting():  # the interpreter runs on CPU tensors (tests)
            raise ValueError(f"the cuda ops backend runs on a CUDA device, not on {device}")
        from .cuda import CudaOps

        return CudaOps()
    raise ValueError(f"unknown ops backend {name!r} (choose from {', '.join(BACKENDS)})")


def _auto(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        from minisgl.kernels.triton import triton_available

        return "cuda" if triton_available() else "torch"
    return "torch"


def bind_ops(model: nn.Module, ops: TorchOps) -> None:
    """Make every layer of `model` call `ops` (the engine does this once, when it is built)."""
    for module in model.modules():
        if isinstance(module, OpsUser):
            module.ops = ops

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

from minisgl.kernels import check_device, device_kernels

from .torch_ops import REFERENCE_OPS, OpsUser, TorchOps

__all__ = ["BACKENDS", "REFERENCE_OPS", "OpsUser", "TorchOps", "bind_ops", "create_ops"]

BACKENDS = ("auto", "torch", "cpu", "cuda")
_ON_KERNELS = {"cpu": "cpu", "triton": "cuda", "torch": "torch"}  # the ops backend on each kind


def create_ops(name: str, device: torch.device | str) -> TorchOps:
    """The ops backend `name` for this device; `auto` picks the fastest one available."""
    device = torch.device(device)
    if name == "auto":
        name = _ON_KERNELS[device_kernels(device)]
    if name == "torch":
        return TorchOps()
    if name == "cpu":
        check_device("cpu", device, "cpu ops backend")
        from .cpu import CpuOps

        return CpuOps()
    if name == "cuda":
        check_device("triton", device, "cuda ops backend")
        from .cuda import CudaOps

        return CudaOps()
    raise ValueError(f"unknown ops backend {name!r} (choose from {', '.join(BACKENDS)})")


def bind_ops(model: nn.Module, ops: TorchOps) -> None:
    """Make every layer of `model` call `ops` (the engine does this once, when it is built)."""
    for module in model.modules():
        if isinstance(module, OpsUser):
            module.ops = ops

"""Choosing an ops backend by name (`--ops-backend`) and binding it to a model's layers."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.kernels import check_device, device_kernels

from . import BACKENDS
from .torch_ops import OpsUser, TorchOps

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
    ops.adopt(model)

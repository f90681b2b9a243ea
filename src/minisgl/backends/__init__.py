"""minisgl.backends: the ops a model calls (linear, norm with residual, rotary, activation), one
backend per device, chosen once when the engine is built.

- `torch` (`TorchOps`): the readable reference in plain torch, any device; every other backend is
  tested against it. Layers use it until an engine binds another.
- `cpu` (`CpuOps`): minisgl's C kernels (`minisgl.kernels`) and prepacked float32 weights.
- `cuda` (`CudaOps`): fused Triton kernels (`minisgl.kernels.triton`); cuBLAS for the matmuls.

`bind_ops(model, ops)` hands the chosen backend to every layer of a model: a transform applied once,
so layer code has no device or kernel branches. Only the names load with the package (the configs
check them without torch); the rest loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from .create import bind_ops, create_ops
    from .torch_ops import REFERENCE_OPS, OpsUser, TorchOps

__all__ = ["BACKENDS", "REFERENCE_OPS", "OpsUser", "TorchOps", "bind_ops", "create_ops"]

BACKENDS = ("auto", "torch", "cpu", "cuda")

__getattr__ = lazy_exports(
    __name__,
    {
        "REFERENCE_OPS": ".torch_ops",
        "OpsUser": ".torch_ops",
        "TorchOps": ".torch_ops",
        "bind_ops": ".create",
        "create_ops": ".create",
    },
)

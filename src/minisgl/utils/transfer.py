"""Host data on the device without waiting for the device.

`torch.tensor(values, device="cuda")`, or `.to("cuda")` of a tensor in pageable memory, copies
through a staging buffer and returns only when the copy is done, which on the device's stream means
after every kernel queued before it: a sampler step made after a decode step was launched waited for
the whole forward pass, and the device then idled while the host prepared the next step. A tensor in
pinned memory goes over with `non_blocking=True` in the stream's order and the host goes on at once;
PyTorch's pinned-memory allocator keeps the host block until the copy has run."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    data: torch.Tensor | Sequence[float] | Sequence[int] | float,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`data` (a host tensor, or values for `torch.tensor`) as a tensor on `device`; on a GPU from
    pinned memory, asynchronously (the result is valid in the stream's order)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda" or t.device.type != "cpu":  # (a tensor on a device already: .to)
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)

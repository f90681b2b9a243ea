"""Zeroed int32 counters for kernels whose last program to finish a unit of work does the rest (the
MoE down GEMM's k-sum, the split-K sum of the fp8 skinny matmul): each such kernel leaves them at
zero, so no memset runs before a launch."""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple[str, torch.device], list[torch.Tensor]] = {}  # every buffer made (the last the largest)


def zeroed_counters(numel: int, device: torch.device, user: str) -> torch.Tensor:
    """int32 zeros a kernel (`user`) leaves zeroed: a buffer per kernel and device, grown as needed.
    Outgrown buffers are kept: CUDA graphs captured with them still use them. One made during a
    capture is that graph's own (its replays zero it first) and is not kept here."""
    kept = _COUNTERS.setdefault((user, device), [])
    if kept and kept[-1].numel() >= numel:
        return kept[-1][:numel]
    zeros = torch.zeros(max(numel, 1 << 14), dtype=torch.int32, device=device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        kept.append(zeros)
    return zeros[:numel]

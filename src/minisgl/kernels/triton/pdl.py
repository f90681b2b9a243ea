"""Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the
kernel before it in the stream is still running, and waits (`gdc_wait`) for that kernel's completion
and its memory before it reads anything; each such kernel also lets the next one launch as soon as
all its programs have started (`gdc_launch_dependents`). In a CUDA graph of a decode step, where
most kernels are short, this hides the launch gap between two kernels. Every kernel launched this
way waits before its first load, so completion still chains: kernel n+1 finishes after kernel n.

`MINISGL_PDL=0` turns it off (for A/B timing)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return (
        os.environ.get("MINISGL_PDL", "1") not in ("", "0")
        and torch.cuda.get_device_capability(index)[0] >= 9
    )


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels writing or reading `t` launch with programmatic dependent launch."""
    if t.device.type != "cuda":
        return False
    return _device_has_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_launch(pdl: bool) -> dict[str, bool]:
    """A launch's keyword for `use_pdl`'s answer (given only where set: the interpreter takes none)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first step: wait for the kernel before it (PDL launched), then let the next one in."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

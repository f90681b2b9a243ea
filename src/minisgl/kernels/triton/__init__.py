"""minisgl.kernels.triton: minisgl's Triton kernels for CUDA (fused element-wise ops, paged attention).

Triton ships with torch's CUDA builds, so nothing new is installed; importing this package does not
import triton (`triton_available()` says whether it can). The kernels also run under Triton's
interpreter (`TRITON_INTERPRET=1`) on CPU tensors, which is how the CPU test suite checks their
logic on small shapes.
"""

from __future__ import annotations

import functools
import os


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

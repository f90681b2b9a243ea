"""The SIGTERM handler of minisgl's processes."""

from __future__ import annotations

from types import FrameType


def raise_exit(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001 (a handler's signature)
    """Leave through SystemExit(0), so that `finally` blocks and context managers close what is open."""
    raise SystemExit(0)

"""minisgl.scheduler: the Scheduler and its process entry point.

Kept light: `minisgl.scheduler.config` is imported by processes that never load torch models, so the
scheduler itself (which imports the engine) is only imported when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .entry import run_scheduler
    from .scheduler import Scheduler

__all__ = ["Scheduler", "run_scheduler"]


def __getattr__(name: str) -> object:
    if name == "Scheduler":
        from .scheduler import Scheduler

        return Scheduler
    if name == "run_scheduler":
        from .entry import run_scheduler

        return run_scheduler
    raise AttributeError(f"module 'minisgl.scheduler' has no attribute {name!r}")

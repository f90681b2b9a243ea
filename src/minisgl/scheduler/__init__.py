"""minisgl.scheduler: the Scheduler and its process entry point.

Kept light: `minisgl.scheduler.config` is imported by processes that never load torch models, so the
scheduler itself (which imports the engine) is only imported when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = ["Scheduler", "run_scheduler"]


def run_scheduler(config: Any, ready_conn: Any) -> None:
    """Process entry: see `minisgl.scheduler.entry.run_scheduler`."""
    from .entry import run_scheduler as _run

    _run(config, ready_conn)


def __getattr__(name: str) -> Any:
    if name == "Scheduler":
        from .scheduler import Scheduler

        return Scheduler
    raise AttributeError(f"module 'minisgl.scheduler' has no attribute {name!r}")

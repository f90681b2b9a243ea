"""minisgl.utils: ZMQ queues (mp.py), the logging helper (logger.py), ipc addresses (ipc.py), misc.

The queue names are loaded on first access, so `import minisgl.utils.hf` (say) does not pull in zmq.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .logger import init_logger

__all__ = [
    "ZmqAsyncPullQueue",
    "ZmqAsyncPushQueue",
    "ZmqPubQueue",
    "ZmqPullQueue",
    "ZmqPushQueue",
    "ZmqSubQueue",
    "init_logger",
]

if TYPE_CHECKING:
    from .mp import (
        ZmqAsyncPullQueue,
        ZmqAsyncPushQueue,
        ZmqPubQueue,
        ZmqPullQueue,
        ZmqPushQueue,
        ZmqSubQueue,
    )


def __getattr__(name: str) -> Any:
    if name.startswith("Zmq"):
        from . import mp

        if hasattr(mp, name):
            return getattr(mp, name)
    raise AttributeError(f"module 'minisgl.utils' has no attribute {name!r}")

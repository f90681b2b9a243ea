"""Progress bars (tqdm) that leave no semaphore behind.

tqdm guards its bars with a multiprocessing RLock, a named POSIX semaphore registered with
multiprocessing's resource tracker, which the launcher shares with its children. A child leaves
with `os._exit` (see `minisgl.launch.child`), so the lock's finalizer never unregisters it, and at
the server's stop the tracker warned "There appear to be 1 leaked semaphore objects". Each process
draws its own bars from one thread at a time, so a thread lock is all they need.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")

_LOCK = threading.RLock()


def progress_bar(iterable: Iterable[T] | None = None, **kwargs: Any) -> tqdm[Any]:
    """`tqdm(iterable, **kwargs)` guarded by a thread lock instead of a multiprocessing one."""
    tqdm.set_lock(_LOCK)
    return tqdm(iterable, **kwargs)

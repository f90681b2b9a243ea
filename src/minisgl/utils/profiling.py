"""Opt-in cProfile of a server process, for finding where a serving pipeline spends its host time.

With `MINISGL_CPROFILE=DIR` in the environment, the launcher (API server) and each child it starts
(scheduler ranks, tokenizer workers) profile their main thread and write `DIR/<role>-<pid>.prof` when
they stop cleanly; read them with `python -m pstats` or `benchmarks/print_profiles.py`."""

from __future__ import annotations

import cProfile
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV = "MINISGL_CPROFILE"


@contextmanager
def maybe_profile(role: str) -> Iterator[None]:
    """Profile the block when MINISGL_CPROFILE names a directory; otherwise do nothing."""
    out = os.environ.get(ENV)
    if not out:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        Path(out).mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(Path(out) / f"{role}-{os.getpid()}.prof"))

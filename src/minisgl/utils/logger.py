"""`init_logger(name)`: a module logger, with one stderr handler set up for the minisgl tree.

Level from MINISGL_LOG_LEVEL (default INFO). Lines carry the process id, since a server is several
processes writing to one terminal.
"""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s %(levelname).1s [%(process)d %(name)s] %(message)s"
_configured = False


def init_logger(name: str) -> logging.Logger:
    """`logger = init_logger(__name__)` at the top of a module."""
    global _configured
    if not _configured:
        root = logging.getLogger("minisgl")
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
            root.addHandler(handler)
            apply_level_from_env()
        _configured = True
    return logging.getLogger(name)


def apply_level_from_env() -> None:
    """Set the minisgl tree's level from MINISGL_LOG_LEVEL (again: a warm interpreter, launch/warm.py,
    imported its modules before the launcher's environment reached it)."""
    level = os.environ.get("MINISGL_LOG_LEVEL", "INFO").upper()
    logging.getLogger("minisgl").setLevel(level if isinstance(logging.getLevelName(level), int) else "INFO")

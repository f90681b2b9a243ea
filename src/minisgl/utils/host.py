"""What this machine lends a server: a free TCP port, and the directory for caches."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (a `tcp://` rendezvous, a child server's HTTP port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ip_facing(host: str) -> str:
    """This machine's address on the interface that reaches `host` (no packet is sent): what a rank on
    another machine than node 0 binds, rather than every interface."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def cache_dir() -> Path:
    """Where converted GGUF models and built kernels are kept: $MINISGL_CACHE_DIR, else
    ~/.cache/minisgl (not created here)."""
    env = os.environ.get("MINISGL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "minisgl"


def release_free_memory() -> bool:
    """Hands the C heap's free pages back to the OS (glibc's malloc_trim): a busy step's scratch
    (prefill activations, kernel buffers) otherwise stays resident after the work ends. False where
    the C library has no malloc_trim (not glibc)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return False
    if trim is None:
        return False
    trim(ctypes.c_size_t(0))
    return True

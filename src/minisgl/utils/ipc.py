"""Private, short directories for one server's ipc:// sockets.

A server's sockets live in `<root>/msgl-<suffix>/` (root: $MINISGL_IPC_ROOT or /tmp), created 0700
and owned by the current user, so another user cannot connect to them or plant a socket there, and
two servers (different suffixes) never collide. The path is a pure function of the suffix: every
process of one server derives the same addresses. `remove_ipc_dir` deletes it when the server stops.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

from .mp import check_addr

_SAFE = re.compile(r"[A-Za-z0-9._-]{1,32}")


def new_suffix() -> str:
    """A suffix unique to this process and call: pid + random."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def ipc_root() -> Path:
    return Path(os.environ.get("MINISGL_IPC_ROOT", "/tmp"))


def ipc_dir_for(suffix: str) -> Path:
    """The directory of one server (not created). Odd or long suffixes are hashed to stay short."""
    if not isinstance(suffix, str) or not suffix:
        raise ValueError(f"the ipc suffix must be a non-empty str, got {suffix!r}")
    name = suffix if _SAFE.fullmatch(suffix) else hashlib.sha256(suffix.encode()).hexdigest()[:16]
    return ipc_root() / f"msgl-{name}"


def ensure_private_dir(path: Path) -> Path:
    """Create `path` 0700 if missing; refuse one that is not ours or is open to others."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} exists and is not a directory")
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"{path} is not a private directory of this user (mode {oct(st.st_mode)})")
    return path


def ipc_addr(directory: Path | str, name: str) -> str:
    """`ipc://<directory>/<name>`, refused (ValueError) if longer than a Unix socket path may be."""
    if not name or "/" in name:
        raise ValueError(f"bad ipc socket name {name!r}")
    return check_addr(f"ipc://{directory}/{name}")


def remove_ipc_dir(path: Path | str) -> None:
    """Delete a server's ipc directory (missing is fine)."""
    shutil.rmtree(path, ignore_errors=True)

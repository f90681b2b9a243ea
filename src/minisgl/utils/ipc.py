"""Private, short directories for one server's ipc:// sockets.

A server's sockets live in `<root>/msgl-<suffix>/` (root: $MINISGL_IPC_ROOT or /tmp), created 0700
and owned by the current user, so another user cannot connect to them or plant a socket there, and
two servers (different suffixes) never collide. The path is a pure function of the suffix: every
process of one server derives the same addresses. `remove_ipc_dir` deletes it when the server stops.

"The last one out removes it": the launcher removes the directory after a normal stop, but if the
launcher is killed (SIGKILL) its children outlive it briefly. So every child process of a server
holds a shared `flock` on `<dir>/.alive` (`IpcDirLease`); on its way out a child trades it for an
exclusive lock without waiting, which succeeds only if no other child still holds one, and then
removes the directory. (A failed trade drops the shared lock, so of children leaving together one
always succeeds.) The kernel drops a dead process's lock, however it died. The launcher holds no
share: the kernel signals its death to the children when its main thread exits, possibly before its
files are closed, and a share still held then would make every child think another one is left.
"""

from __future__ import annotations

import fcntl
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


class IpcDirLease:
    """A process's share of a server's ipc directory (see the module docstring)."""

    LOCK_NAME = ".alive"

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._fd: int | None = os.open(self.path / self.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def leave(self) -> bool:
        """Give up this process's share; remove the directory if no other process holds one.
        Returns True if this call removed it. Idempotent."""
        if self._fd is None:
            return False
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process still holds a share: it (or a later one) removes it
            return False
        else:
            remove_ipc_dir(self.path)
            return True
        finally:
            os.close(fd)

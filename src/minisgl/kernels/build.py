"""Build (once per machine and source version) and load the CPU kernels in `cpu_kernels.c`.

The shared library is compiled with the system's C compiler into the cache directory
(`$MINISGL_CACHE_DIR` or `~/.cache/minisgl`, under `kernels/<hash>/`), where the hash covers the
source, the compiler's version and the flags, so a changed file or a new machine builds afresh. A
build takes about a second. Without a compiler, or when the build fails, `load()` returns None, says
why once in the log, and every caller keeps its plain-torch path. `MINISGL_CPU_KERNELS=0` turns the
kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from minisgl.utils.host import cache_dir

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_tried = False

_ptr = ctypes.c_void_p  # raw data pointers (tensor.data_ptr())
_SIGNATURES: dict[str, list] = {
    "minisgl_decode_attention": [_ptr, _ptr, _ptr, _ptr, ctypes.c_int64]
    + [_ptr]
    + [ctypes.c_int64] * 5
    + [ctypes.c_float, _ptr],
    "minisgl_prefill_attention": [_ptr] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_float, _ptr],
    "minisgl_add_rmsnorm": [
        _ptr,
        _ptr,
        _ptr,
        ctypes.c_float,
        ctypes.c_int64,
        ctypes.c_int64,
    ]
    + [_ptr],
    "minisgl_rope_split": [_ptr] * 3 + [ctypes.c_int64] * 4 + [_ptr] * 3,
    "minisgl_silu_mul": [_ptr, ctypes.c_int64, ctypes.c_int64, _ptr],
    "minisgl_pack_weight": [_ptr, ctypes.c_int64, ctypes.c_int64, _ptr],
    "minisgl_packed_matmul": [_ptr, ctypes.c_int64, ctypes.c_int64, _ptr, ctypes.c_int64] + [_ptr, _ptr],
    "minisgl_moe": [_ptr, ctypes.c_int64, ctypes.c_int64, _ptr, _ptr] + [ctypes.c_int64] * 3 + [_ptr] * 7,
}
_VOID = {"minisgl_add_rmsnorm", "minisgl_rope_split", "minisgl_silu_mul", "minisgl_pack_weight"}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), version, *_FLAGS]).encode()).hexdigest()[:16]
    out_dir = cache_dir() / "kernels" / key
    lib = out_dir / "libminisgl_cpu.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # build aside, then rename: atomic
        tmp_lib = Path(tmp) / lib.name
        proc = subprocess.run(
            [cc, *_FLAGS, str(_SOURCE), "-o", str(tmp_lib), "-lm"], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp_lib, lib)
    logger.info("built the CPU kernels into %s", lib)
    return lib


def load() -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None when it cannot be had on this machine."""
    global _loaded, _tried
    if _tried:
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        if os.environ.get("MINISGL_CPU_KERNELS", "1") == "0":
            logger.info("CPU kernels turned off by MINISGL_CPU_KERNELS=0: plain torch ops are used")
            return None
        cc = _compiler()
        if cc is None:
            logger.warning("no C compiler found: the CPU kernels are off, plain torch ops are used")
            return None
        try:
            import torch  # noqa: F401 - its libgomp must be loaded first, so the kernels share it

            lib = ctypes.CDLL(str(_build(cc)))
            for name, args in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, (None if name in _VOID else ctypes.c_int)
        except Exception as e:  # a failed build must never take the engine down
            logger.warning("could not build the CPU kernels (%s): plain torch ops are used", e)
            return None
        _loaded = lib
        return lib

"""Build (once per machine and source version) and load the CPU kernels: `cpu_kernels.c` (`load()`)
and the quantized-weight kernels `cpu_quant.c` (`load_quant()`).

A shared library is compiled with the system's C compiler into the cache directory
(`$MINISGL_CACHE_DIR` or `~/.cache/minisgl`, under `kernels/<hash>/`), where the hash covers the
source, the compiler's version and the flags, so a changed file or a new machine builds afresh. A
build takes about a second. Without a compiler, or when the build fails, `load()` returns None, says
why once in the log, and every caller keeps its plain-torch path. `MINISGL_CPU_KERNELS=0` turns the
kernels off.

`cpu_quant.c` is built for one instruction set, chosen once per process (`quant_isa()`): `amx`
(`avx512` plus AMX-BF16 tiles for prefill passes, where Linux grants the tile state), `avx512bf16`
(`avx512` plus bfloat16 dot products for prefill passes, e.g. AMD Zen 4), `avx512` (AVX-512 F/BW/VL/DQ
with VNNI), `avx2` (AVX2, FMA, F16C) or `portable`, the best this CPU runs unless
`MINISGL_CPU_ISA` names one; the tests build every one the CPU runs (`load_quant(isa)`).
"""

from __future__ import annotations

import ctypes
import functools
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
_QUANT_SOURCE = Path(__file__).with_name("cpu_quant.c")
_COMMON = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
_FLAGS = ["-march=native", *_COMMON]
# The instruction sets of cpu_quant.c: (compiler flags, the /proc/cpuinfo flags a CPU needs for them)
ISAS: dict[str, tuple[list[str], set[str]]] = {
    "amx": (  # avx512 plus AMX-BF16 tiles for prefill passes
        [
            "-DMINISGL_AVX512",
            "-DMINISGL_AMX",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mavx512vnni",
        ]
        + ["-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mavx2", "-mfma", "-mf16c"],
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}
        | {"avx2", "fma", "f16c"},
    ),
    "avx512bf16": (  # avx512 plus bfloat16 dot products (vdpbf16ps) for prefill passes, no AMX
        ["-DMINISGL_AVX512", "-DMINISGL_BF16", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
        + ["-mavx512vnni", "-mavx512bf16", "-mavx2", "-mfma", "-mf16c"],
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "avx2", "fma", "f16c"},
    ),
    "avx512": (
        ["-DMINISGL_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
        + ["-mavx2", "-mfma", "-mf16c"],
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"},
    ),
    "avx2": (["-DMINISGL_AVX2", "-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}),
    "portable": ([], set()),
}
_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_tried = False
_quant: dict[str, ctypes.CDLL | None] = {}
_MISSING = object()

_ptr = ctypes.c_void_p  # raw data pointers (tensor.data_ptr())
_SIGNATURES: dict[str, list] = {
    "minisgl_decode_attention": [_ptr, _ptr, _ptr, _ptr, ctypes.c_int64]
    + [_ptr]
    + [ctypes.c_int64] * 5
    + [ctypes.c_float, _ptr],
    "minisgl_decode_attention_f16": [_ptr, _ptr, _ptr, _ptr, ctypes.c_int64]
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
    "minisgl_rope_store": [_ptr] * 3 + [ctypes.c_int64] * 4 + [_ptr] * 3 + [ctypes.c_int, _ptr],
    "minisgl_silu_mul": [_ptr, ctypes.c_int64, ctypes.c_int64, _ptr],
    "minisgl_pack_weight": [_ptr, ctypes.c_int64, ctypes.c_int64, _ptr],
    "minisgl_packed_matmul": [_ptr, ctypes.c_int64, ctypes.c_int64, _ptr, ctypes.c_int64] + [_ptr, _ptr],
    "minisgl_moe": [_ptr, ctypes.c_int64, ctypes.c_int64, _ptr, _ptr] + [ctypes.c_int64] * 3 + [_ptr] * 7,
}
# The packed entry points (one int64 argument array each; minisgl.kernels.graph) and their replay.
_PACKED = [
    "minisgl_decode_attention_packed",
    "minisgl_extend_attention_packed",
    "minisgl_rope_store_packed",
    "minisgl_add_rmsnorm_packed",
    "minisgl_gather_rows_packed",
    "minisgl_argmax_rows_packed",
]
_SIGNATURES.update({name: [_ptr] for name in _PACKED})
_SIGNATURES["minisgl_graph_run"] = [_ptr, ctypes.c_int64]
_SIGNATURES["minisgl_graph_profile"] = [_ptr, ctypes.c_int64, _ptr]
_VOID = {
    "minisgl_add_rmsnorm",
    "minisgl_rope_split",
    "minisgl_rope_store",
    "minisgl_silu_mul",
    "minisgl_pack_weight",
}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _identity(cc: str) -> str:
    """What tells one compiler install from another, for the build cache's key: the resolved
    executable's path, size and modification time. (`cc --version` would say it too, but costs a
    subprocess at every process start, on the server's start-up path.)"""
    path = shutil.which(cc) or cc
    real = os.path.realpath(path)
    st = os.stat(real)
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


def _build(
    cc: str, source: Path = _SOURCE, flags: list[str] = _FLAGS, name: str = "libminisgl_cpu.so"
) -> Path:
    key = hashlib.sha256("\0".join([source.read_text(), _identity(cc), *flags]).encode()).hexdigest()[:16]
    out_dir = cache_dir() / "kernels" / key
    lib = out_dir / name
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # build aside, then rename: atomic
        tmp_lib = Path(tmp) / lib.name
        proc = subprocess.run(
            [cc, *flags, str(source), "-o", str(tmp_lib), "-lm"], capture_output=True, text=True
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


_QUANT_SIGNATURES: dict[str, list] = {
    "minisgl_qlinear": [
        _ptr,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        _ptr,
        ctypes.c_float,
    ]
    + [_ptr, _ptr, ctypes.c_int64, _ptr, _ptr, ctypes.c_int64, ctypes.c_int],
    "minisgl_dequant_rows": [_ptr, _ptr, ctypes.c_int64, _ptr, ctypes.c_int64, ctypes.c_int64, _ptr],
    "minisgl_qlinear_packed": [_ptr],
    "minisgl_dequant_rows_packed": [_ptr],
    "minisgl_repack_bytes": [_ptr, ctypes.c_int64, ctypes.c_int64, _ptr],
    "minisgl_repack_rows": [_ptr, _ptr, ctypes.c_int64, ctypes.c_int64, _ptr, _ptr, _ptr],
    "minisgl_repack_supported": [],
}


@functools.cache
def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere: the portable kernels)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def quant_isa() -> str:
    """The instruction set of the quantized kernels in this process (chosen once): MINISGL_CPU_ISA,
    or the best one this CPU has."""
    forced = os.environ.get("MINISGL_CPU_ISA", "auto")
    if forced != "auto":
        if forced not in ISAS:
            raise ValueError(f"MINISGL_CPU_ISA={forced!r}: choose from auto, {', '.join(ISAS)}")
        return forced
    flags = cpu_flags()
    for isa, (_, need) in ISAS.items():
        if need <= flags and (isa != "amx" or load_quant("amx") is not None):  # AMX: if Linux grants it
            return isa
    return "portable"


def load_quant(isa: str | None = None) -> ctypes.CDLL | None:
    """The quantized-weight kernels built for `isa` (default: `quant_isa()`), or None when they cannot
    be had here (no compiler, a failed build, MINISGL_CPU_KERNELS=0, a CPU without that `isa`)."""
    lib = _quant.get(isa or quant_isa(), _MISSING)
    if lib is not _MISSING:
        return lib  # type: ignore[return-value]
    isa = isa or quant_isa()
    with _lock:
        if isa not in _quant:
            _quant[isa] = _load_quant(isa)
        return _quant[isa]


def _load_quant(isa: str) -> ctypes.CDLL | None:
    if os.environ.get("MINISGL_CPU_KERNELS", "1") == "0":
        return None
    flags, need = ISAS[isa]
    if not need <= cpu_flags():
        logger.warning("this CPU lacks %s for the %s kernels", sorted(need - cpu_flags()), isa)
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found: quantized weights use the plain-torch path")
        return None
    try:
        import torch  # noqa: F401 - its libgomp first, as in load()

        lib = ctypes.CDLL(str(_build(cc, _QUANT_SOURCE, [*flags, *_COMMON], f"libminisgl_quant_{isa}.so")))
        for name, args in _QUANT_SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        lib.minisgl_quant_isa.restype = ctypes.c_char_p
        if isa == "amx" and not lib.minisgl_amx_init():
            logger.info("Linux refused the AMX tile state: the avx512 kernels are used")
            return None
    except Exception as e:  # a failed build must never take the engine down
        logger.warning("could not build the %s quantized kernels (%s): the plain-torch path is used", isa, e)
        return None
    return lib

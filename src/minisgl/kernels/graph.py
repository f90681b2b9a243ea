"""Recording the CPU kernel calls of a forward pass and replaying them in one C call: the CPU's
counterpart of a CUDA graph (`minisgl.engine.cpu_graph` captures and replays decode steps with it).

Every CPU kernel wrapper calls its kernel through `call(fn, args, keep)`: the arguments as one int64
array (pointers, sizes; floats as their bits), passed to the kernel's packed entry point. While a
`Recorder` is active the call is also appended to the recorder's program, and output tensors come
from `empty()`, which then hands out the recorder's buffers: the same buffer, by order of allocation,
in every program recorded with that pool, so programs of different batch sizes share one set (each
buffer has the pool's largest batch of rows; a program uses the first rows). `keep` holds the tensors
an op reads, so no address in a program ever points at freed memory. `Program.run()` replays every
op in order (`minisgl_graph_run`): the Python between kernels (module calls, checks, allocation) is
what it saves, a few microseconds per op. Torch operations that compute between kernels are not
recorded: whoever records must check that a replay gives the eager results (`cpu_graph` does).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_recorder: Recorder | None = None


def float_bits(x: float) -> int:
    """A float32's bits as an int (how packed arguments carry floats)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


class BufferPool:
    """Output buffers of recorded programs, by order of allocation; `rows` each along dim 0."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.buffers: list[torch.Tensor] = []

    def get(self, i: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if shape[0] > self.rows:
            raise ValueError(f"a recorded batch of {shape[0]} rows exceeds the pool's {self.rows}")
        full = (self.rows, *shape[1:])
        if i == len(self.buffers):  # empty: a program writes its rows before it reads them
            self.buffers.append(torch.empty(full, dtype=dtype))
        buf = self.buffers[i]
        if tuple(buf.shape) != full or buf.dtype != dtype:
            raise ValueError(
                f"recorded allocation {i} is {full} {dtype}, another program had {tuple(buf.shape)}"
            )
        return buf[: shape[0]]


class Recorder:
    """The ops of one forward pass, while it runs (`with Recorder(pool) as rec: ...`)."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self.ops: list[tuple[int, tuple[int, ...]]] = []
        self.kept: list[torch.Tensor] = []
        self._allocs = 0

    def __enter__(self) -> Recorder:
        global _recorder
        if _recorder is not None:
            raise RuntimeError("a Recorder is already active")
        _recorder = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _recorder
        _recorder = None

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        self._allocs += 1
        return self.pool.get(self._allocs - 1, shape, dtype)

    def program(self) -> Program:
        return Program(self.ops, self.kept)


class Program:
    """Recorded ops, replayed in order by one C call."""

    def __init__(self, ops: list[tuple[int, tuple[int, ...]]], kept: list[torch.Tensor]) -> None:
        flat: list[int] = []
        for fn, args in ops:
            flat += [fn, len(args), *args]
        self.code = np.array(flat, dtype=np.int64)
        self.num_ops = len(ops)
        self._kept = kept

    def run(self) -> None:
        from .build import load

        lib = load()
        assert lib is not None, "a program was recorded, so the kernels exist"
        rc = lib.minisgl_graph_run(self.code.ctypes.data, self.num_ops)
        if rc != 0:
            raise RuntimeError(f"a replayed CPU kernel failed ({rc})")

    def profile(self, ns: np.ndarray) -> None:
        """`run()`, adding each op's wall time in nanoseconds to ns[i] ((num_ops,) int64)."""
        from .build import load

        lib = load()
        assert lib is not None, "a program was recorded, so the kernels exist"
        assert ns.dtype == np.int64 and ns.shape == (self.num_ops,) and ns.flags.c_contiguous
        rc = lib.minisgl_graph_profile(self.code.ctypes.data, self.num_ops, ns.ctypes.data)
        if rc != 0:
            raise RuntimeError(f"a replayed CPU kernel failed ({rc})")

    def ops(self) -> list[tuple[int, np.ndarray]]:
        """Each op as (its function's address, its packed arguments)."""
        out, i = [], 0
        for _ in range(self.num_ops):
            n = int(self.code[i + 1])
            out.append((int(self.code[i]), self.code[i + 2 : i + 2 + n]))
            i += 2 + n
        return out


def empty(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An output tensor: the recorder's buffer while recording, else a new one."""
    if _recorder is not None:
        return _recorder.empty(shape, dtype)
    return torch.empty(tuple(shape), dtype=dtype)


def call(fn: Any, args: Sequence[int], keep: Sequence[torch.Tensor] = ()) -> int:
    """fn(args) through the kernel's packed entry point; recorded when a Recorder is active."""
    if _recorder is not None:
        _recorder.ops.append((ctypes.cast(fn, ctypes.c_void_p).value or 0, tuple(args)))
        _recorder.kept.extend(keep)
    return fn((ctypes.c_int64 * len(args))(*args))


def recording() -> bool:
    return _recorder is not None

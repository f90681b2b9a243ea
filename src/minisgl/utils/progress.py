"""Scheduler ranks' progress, seen by their launcher: one int64 per rank in a small shared file.

The launcher creates `<ipc dir>/progress` (one slot per scheduler rank on its machine) before it
starts the ranks; each rank maps it and, every time its loop comes round, stores
`rounds << 1 | busy` in its slot: one 8-byte store per scheduler step, no syscall, no message. The
launcher reads the slots a few times a second and notes, on its own clock, when a slot last changed
(`watchdog.py`). A value read half-written only looks like a change, which delays a verdict by one
poll and never causes one.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

FILE_NAME = "progress"
_SLOT_BYTES = 8


class ProgressBoard:
    """The shared slots, mapped: the launcher `create`s and reads them, a rank `open`s its own."""

    def __init__(self, path: Path, create_slots: int = 0) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create_slots else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create_slots:
                os.ftruncate(fd, create_slots * _SLOT_BYTES)
            self._map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self._slots = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, directory: Path | str, slots: int) -> ProgressBoard:
        if slots < 1:
            raise ValueError(f"a progress board needs at least one slot, got {slots}")
        return cls(Path(directory) / FILE_NAME, create_slots=slots)

    @classmethod
    def open(cls, directory: Path | str) -> ProgressBoard:
        return cls(Path(directory) / FILE_NAME)

    def __len__(self) -> int:
        return len(self._slots)

    def read(self, slot: int) -> int:
        return self._slots[slot]

    def write(self, slot: int, value: int) -> None:
        self._slots[slot] = value


class ProgressBeat:
    """One rank's writer: `beat(busy)` once per loop round."""

    def __init__(self, board: ProgressBoard, slot: int) -> None:
        if not 0 <= slot < len(board):
            raise ValueError(f"progress slot {slot} outside the board's {len(board)} slots")
        self._board, self._slot, self._rounds = board, slot, 0

    def beat(self, busy: bool) -> None:
        self._rounds += 1
        self._board.write(self._slot, (self._rounds << 1) | busy)


def is_busy(value: int) -> bool:
    """Whether the rank had work when it wrote `value` (False: it was about to wait for messages)."""
    return bool(value & 1)

"""The launcher's watch over its scheduler ranks: a rank stalled past --stall-timeout turns /health
503 (until it moves again), one stalled past --watchdog-timeout has its threads' stacks logged and
ends the server (exit code 1, requests in flight end with "abort") so that a supervisor restarts it.

Progress is a rank's loop coming round (`utils/progress.py`), not a token: one round may be a long
step (a big prefill on the CPU), but every legitimate step ends. A rank has work when its last
round said so (busy), or, its loop asleep waiting for messages, when a request on its replica was
accepted by the tokenizer after that round: a rank stopped while idle never wakes to say busy, and a
request that reached an idle, live rank wakes it within milliseconds. Its stall is the time since
its slot last changed (busy), or since the first such request arrived (asleep).

Every launcher watches the ranks of its own machine (`--nnodes`: node K's runner watches node K's
ranks and, when its watchdog fires, reports the failure to node 0, which stops the server; only node
0's own ranks appear as "stalled" on /health). A rank of a tensor-parallel group that waits in a
collective for a stalled peer stalls too: the watchdog names every stalled rank and logs the stacks
of each.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minisgl.utils.progress import ProgressBoard, is_busy
from minisgl.utils.signals import STACKS_SIGNAL

if TYPE_CHECKING:
    from minisgl.launch.processes import Child
    from minisgl.scheduler.config import SchedulerConfig

logger = logging.getLogger("minisgl.launcher")

# How long a rank gets to write its stacks to the log before the server stops it.
DUMP_WAIT_S = 1.0

# (replica, after) -> the earliest time after `after` at which a request on that replica that is
# still in flight was accepted, or None (`FrontendManager.first_accepted_after`).
WorkAfter = Callable[[int, float], float | None]


def _no_work(replica: int, after: float) -> float | None:  # noqa: ARG001
    return None


@dataclass(frozen=True)
class WatchedRank:
    name: str  # as the launcher names it ("scheduler replica 1 rank 0")
    replica: int
    pid: int
    slot: int  # on the progress board


@dataclass(frozen=True)
class Stall:
    rank: WatchedRank
    seconds: float

    def describe(self) -> str:
        return f"{self.rank.name} (pid {self.rank.pid}) made no progress for {self.seconds:.1f} s"


@dataclass
class _Seen:
    value: int  # the slot's value, as last read
    at: float  # the first poll that read it
    before: float  # the poll before that one: the rank moved in between


class Watchdog:
    """Polled by its launcher a few times a second; `stall_s` / `timeout_s` 0 turn either part off."""

    def __init__(
        self,
        board: ProgressBoard,
        ranks: list[WatchedRank],
        stall_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.board, self.ranks, self.stall_s, self.timeout_s, self._clock = (
            board,
            ranks,
            stall_s,
            timeout_s,
            clock,
        )
        now = clock()
        self._seen = [_Seen(board.read(r.slot), now, now) for r in ranks]
        self._last_poll = now
        self._reported: set[int] = set()  # slots logged as stalled (and not yet recovered)

    @property
    def enabled(self) -> bool:
        return bool(self.stall_s or self.timeout_s)

    def poll(self, work_after: WorkAfter = _no_work) -> tuple[list[Stall], list[Stall]]:
        """(ranks stalled past stall_s, ranks stalled past timeout_s); logs when a rank starts and
        stops being stalled."""
        now = self._clock()
        stalls = [self._stall(r, s, now, work_after) for r, s in zip(self.ranks, self._seen, strict=True)]
        self._last_poll = now
        stalled = [s for s in stalls if s is not None and self.stall_s and s.seconds >= self.stall_s]
        expired = [s for s in stalls if s is not None and self.timeout_s and s.seconds >= self.timeout_s]
        self._log_changes(stalled)
        return stalled, expired

    def _stall(self, rank: WatchedRank, seen: _Seen, now: float, work_after: WorkAfter) -> Stall | None:
        value = self.board.read(rank.slot)
        if value != seen.value:
            seen.value, seen.at, seen.before = value, now, self._last_poll
        if is_busy(value):
            return Stall(rank, now - seen.at)
        arrived = work_after(rank.replica, seen.before)
        return None if arrived is None else Stall(rank, now - arrived)

    def _log_changes(self, stalled: list[Stall]) -> None:
        now_stalled = {s.rank.slot for s in stalled}
        for s in stalled:
            if s.rank.slot not in self._reported:
                logger.warning(
                    "%s with work waiting (--stall-timeout %g): /health says 503", s.describe(), self.stall_s
                )
        for r in self.ranks:
            if r.slot in self._reported and r.slot not in now_stalled:
                logger.warning("%s is making progress again", r.name)
        self._reported = now_stalled


def watch_schedulers(
    board: ProgressBoard,
    children: Sequence[Child],
    configs: Sequence[SchedulerConfig],
    stall_s: float,
    timeout_s: float,
) -> Watchdog:
    """The watchdog of the scheduler ranks `children`, started from `configs`."""
    ranks = [
        WatchedRank(child.name, c.replica, child.process.pid or 0, c.progress_slot)
        for child, c in zip(children, configs, strict=True)
    ]
    return Watchdog(board, ranks, stall_s, timeout_s)


def dump_stacks(pid: int) -> None:
    """Ask a rank to write its threads' stacks to the log; SIGCONT lets a stopped one do it."""
    for sig in (STACKS_SIGNAL, signal.SIGCONT):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


def give_up(expired: list[Stall], timeout_s: float, where: str = "") -> str:
    """Say why the watchdog fired and ask each expired rank for its stacks (give them DUMP_WAIT_S
    before stopping them); returns the failure's message."""
    ranks = "; ".join(s.describe() for s in expired)
    msg = f"{ranks} with work waiting (--watchdog-timeout {timeout_s:g})"
    print(f"minisgl: {where}{msg}: the stacks of its threads follow", file=sys.stderr, flush=True)
    for s in expired:
        dump_stacks(s.rank.pid)
    return msg

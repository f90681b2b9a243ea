"""Requests waiting for their grammar to compile (structured output), off the scheduler's step.

A request with a grammar is not queued for prefill when it arrives: its grammar is handed to the
compiler's worker threads (`GrammarCompiler.submit`, shared by requests with the same grammar) and
the request waits here, in arrival order, while every other request keeps running. Each step the
scheduler takes the requests whose compile is done (admitted with their own matcher), failed, or
has taken longer than `timeout_s` (both refused).

Tensor parallelism: compiles finish at different times on different ranks, but every rank must
admit a request in the same step. With more than one rank, the ranks agree on each waiting
request's state with one all-reduce (MIN over done = 1, still compiling = 0, failed = -1) on the
gloo group, in the steps in which requests wait; a request is admitted once it is done everywhere,
and refused as soon as it failed anywhere.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from minisgl.grammar import GRAMMAR_REFUSED, GrammarCompiler, GrammarError, short_error

if TYPE_CHECKING:
    from llguidance import LLMatcher
    from torch.distributed import ProcessGroup

    from minisgl.core import Req

_DONE, _COMPILING, _FAILED = 1, 0, -1


@dataclass
class _Waiting:
    req: Req
    future: Future[LLMatcher]
    deadline: float


@dataclass
class GrammarWait:
    """The requests whose grammars compile (see the module docstring)."""

    compiler: GrammarCompiler
    timeout_s: float = 60.0
    tp_group: ProcessGroup | None = None
    waiting: list[_Waiting] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, req: Req, grammar: str) -> None:
        future = self.compiler.submit(grammar)
        self.waiting.append(_Waiting(req, future, time.monotonic() + self.timeout_s))

    def remove(self, uid: int) -> Req | None:
        for i, w in enumerate(self.waiting):
            if w.req.uid == uid:
                return self.waiting.pop(i).req
        return None

    def holds(self, uid: int) -> bool:
        return any(w.req.uid == uid for w in self.waiting)

    def pause(self, seconds: float) -> None:
        """Wait up to `seconds` for a compile to finish (the scheduler has nothing else to do)."""
        if self.waiting:
            wait([w.future for w in self.waiting], timeout=seconds, return_when=FIRST_COMPLETED)

    def take_finished(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(requests whose grammar compiled, each with its matcher set; (request, why) for those
        refused), in arrival order; the others keep waiting."""
        if not self.waiting:
            return [], []
        states = self._agreed([self._state(w) for w in self.waiting])
        ready: list[Req] = []
        refused: list[tuple[Req, str]] = []
        still: list[_Waiting] = []
        for w, state in zip(self.waiting, states, strict=True):
            if state == _COMPILING:
                still.append(w)
            elif state == _DONE:
                p = w.req.sampling_params
                w.req.grammar = self.compiler.matcher(w.future, (p.reasoning_start_id, p.reasoning_end_id))
                ready.append(w.req)
            else:
                refused.append((w.req, f"{GRAMMAR_REFUSED}: {self._why(w)}"))
        self.waiting = still
        return ready, refused

    @staticmethod
    def _state(w: _Waiting) -> int:
        if w.future.done():
            return _DONE if w.future.exception() is None else _FAILED
        return _FAILED if time.monotonic() > w.deadline else _COMPILING

    def _agreed(self, states: list[int]) -> list[int]:
        """Every rank's states -> the states all ranks act on (the MIN over ranks)."""
        if self.tp_group is None:
            return states
        import torch.distributed as dist

        t = torch.tensor(states, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_group)
        return [int(s) for s in t.tolist()]

    def _why(self, w: _Waiting) -> str:
        if not w.future.done():
            return f"it did not compile within {self.timeout_s:g} s (make the schema smaller or simpler)"
        error = w.future.exception()
        if error is None:  # compiled here, failed or timed out on another rank
            return "it did not compile on every tensor-parallel rank in time"
        return str(error) if isinstance(error, GrammarError) else short_error(str(error))

"""CPU decode graphs: a decode step's kernel calls recorded once per batch size, then replayed in one
C call (`minisgl.kernels.graph`), so a step no longer pays Python for each of its ~150 kernels.

The CPU's counterpart of `cuda_graph.py`, with its interface (`padded_size`, `replay`). Inputs (token
ids, positions) and the attention backend's decode metadata live in buffers whose addresses never
change; every size's program shares one pool of intermediate buffers (a program uses their first
rows). A size is recorded when it is first met (recording runs the step itself), with no padding:
a batch of B requests replays the program of B. Only a forward pass made entirely of recorded
kernels replays correctly, so the first recording is checked once: the step run eagerly and replayed
on other token ids must give bitwise the same logits (the kernels are deterministic), and the
graphs turn themselves off, with a warning, if not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from minisgl import kernels
from minisgl.kernels.graph import BufferPool, Program, Recorder

from .cuda_graph import Forward, argmax_rows

logger = logging.getLogger(__name__)


class CpuGraphRunner:
    def __init__(
        self, forward: Forward, max_bs: int, vocab_size: int, prepare_ops: Callable[[], None]
    ) -> None:
        self.forward = forward
        self.max_bs = max_bs
        self.vocab_size = vocab_size
        self.inputs = torch.zeros(2, max_bs, dtype=torch.int64)  # ids; positions
        self.pool = BufferPool(max_bs)
        # size -> (program, its logits (B, V), their argmax (B,))
        self.programs: dict[int, tuple[Program, torch.Tensor, torch.Tensor]] = {}
        self.enabled = True
        self.checked = False
        self._prepare_ops = prepare_ops

    def padded_size(self, bs: int) -> int | None:
        """The size a batch of `bs` replays (itself), or None: too large, or graphs turned off."""
        return bs if self.enabled and 0 < bs <= self.max_bs else None

    def replay(
        self, inputs: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs (2, B) int64: token ids, then positions (the attention backend already prepared)
        -> logits (B, V) float32 and their argmax (B,) (the logits valid until the next replay)."""
        bs = inputs.shape[1]
        self.inputs[:, :bs].copy_(inputs)
        if pending is not None:
            self.inputs[0].index_copy_(0, *pending)
        ids, pos = self.inputs[0, :bs], self.inputs[1, :bs]
        if bs not in self.programs:
            logits = self._record(bs, ids, pos)
            return logits, argmax_rows(logits)
        program, logits, best = self.programs[bs]
        program.run()
        return logits, best.clone()  # the buffer is the next replay's

    def _record(self, bs: int, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Record size `bs` while running it (its logits are this step's); check the first one."""
        self._prepare_ops()
        with Recorder(self.pool) as rec:
            logits = self.forward(ids, pos)
            best = kernels.argmax_rows(logits)  # the greedy tokens, in the program too
        program = rec.program()
        if not self.checked and not self._check(program, logits, ids, pos):
            return self.forward(ids, pos)  # this step eagerly; graphs are off from now on
        self.programs[bs] = (program, logits, best)
        return logits

    def _check(self, program: Program, logits: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor) -> bool:
        """Replay on other token ids against the eager step on them, then rerun the real ids (their
        K/V back in the pool). Turns the graphs off on a mismatch."""
        self.checked = True
        real = ids.clone()
        ids.copy_((real + 1) % self.vocab_size)
        eager = self.forward(ids, pos).clone()
        program.run()
        same = torch.equal(logits, eager)
        ids.copy_(real)
        program.run()
        if not same:
            self.enabled = False
            logger.warning("a recorded CPU decode step differs from the eager one: CPU decode graphs are off")
        return same

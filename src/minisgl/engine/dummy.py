"""An engine without a model, for measuring the serving layers alone.

The engine interface (`EngineProtocol`) as `Engine` implements it; it keeps the page bookkeeping (so
the scheduler behaves exactly as with a model) but no KV memory and no weights, and emits
deterministic pseudo-random token ids that are never an EOS id (requests run to max_tokens or a stop
token, so benchmarks see fixed output lengths). It computes on the host when launched, so overlap
scheduling is off unless asked for; asked for, a pending token is read from the step before.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch
from minisgl.kvcache import PageAllocator, PageTable

from .options import EngineOptions
from .step import StepOutput

if TYPE_CHECKING:
    from minisgl.grammar import GrammarCompiler

_DUMMY_NUM_PAGES = 1 << 16


class DummyEngine:
    def __init__(
        self,
        options: EngineOptions,
        vocab_size: int = 32000,
        eos_token_ids: list[int] | None = None,
        max_position_embeddings: int = 8192,
        step_ms: float = 0.0,
    ) -> None:
        if step_ms < 0:
            raise ValueError(f"step_ms must be >= 0, got {step_ms}")
        self.step_s = step_ms / 1000.0  # a stand-in for the model's time per step
        self.options = options
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids or [])
        self.page_size = options.page_size
        self.num_pages = options.num_pages or _DUMMY_NUM_PAGES
        self.max_seq_len = min(
            options.max_seq_len or max_position_embeddings, self.num_pages * self.page_size
        )
        self.page_table = PageTable(
            PageAllocator(self.num_pages), self.page_size, options.max_running_requests, self.max_seq_len
        )
        self._eos = set(self.eos_token_ids)
        self.device = torch.device("cpu")
        self.grammars: GrammarCompiler | None = None  # no model, no structured output
        self.pooling: str | None = None  # no hidden states, no embeddings

    def launch(self, batch: Batch, pending: StepOutput | None = None) -> StepOutput:
        t0 = time.perf_counter()
        if self.step_s:
            time.sleep(self.step_s)
        out = []
        for r, s in zip(batch.reqs, batch.sample_mask, strict=True):
            if s and r.pending:  # its last token is the one the step before sampled
                assert pending is not None, f"request {r.uid} has a pending token but no step before"
                out.append(self._token(r.seq_len + 1, pending.pending_token(r)))
            elif s:
                out.append(self._token(r.seq_len, r.token_ids[-1]))
        return StepOutput(torch.tensor(out, dtype=torch.int64), batch, t0)

    def forward_batch(self, batch: Batch) -> list[int]:
        return self.launch(batch).tolist()

    def _token(self, seq_len: int, last: int) -> int:
        """A fixed hash of (length, last token): the same on every rank and every run."""
        x = (seq_len * 2654435761 + last * 40503 + self.options.seed) % (1 << 32)
        tok = x % self.vocab_size
        while tok in self._eos:
            tok = (tok + 1) % self.vocab_size
        return tok

"""The interface a scheduler drives: `Engine` (a model) and `DummyEngine` (none) both implement it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from minisgl.core import Batch
    from minisgl.grammar import GrammarCompiler
    from minisgl.kvcache import PageTable

    from .step import StepOutput


@runtime_checkable
class EngineProtocol(Protocol):
    """One rank's engine as the scheduler sees it: the KV page table it schedules into, the model's
    limits, a grammar compiler (None: no structured output), its embeddings' pooling (None: none), and
    launching a batch."""

    device: torch.device  # where steps run: overlap scheduling is on by default on a GPU
    page_table: PageTable
    max_seq_len: int
    vocab_size: int
    eos_token_ids: list[int]

    @property
    def grammars(self) -> GrammarCompiler | None:
        """The compiler of structured output's grammars; None: the engine has none."""
        ...

    @property
    def pooling(self) -> str | None:
        """How an embedding request's hidden states are pooled ("last", "mean"); None: the engine
        computes no embeddings."""
        ...

    def launch(self, batch: Batch, pending: StepOutput | None = None) -> StepOutput:
        """Start `batch`; a request with a pending token feeds the one `pending` (the step launched
        before) sampled for it. The tokens come back through the StepOutput."""
        ...

    def forward_batch(self, batch: Batch) -> list[int]:
        """Run `batch` to its sampled tokens (one per request whose chunk ends its tokens)."""
        ...

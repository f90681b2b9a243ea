"""`CausalLM`: what the engine runs, whatever the architecture."""

from __future__ import annotations

import torch
from torch import nn


class CausalLM(nn.Module):
    """A decoder-only language model over a flattened batch: `forward` takes every token of the
    batch to its final hidden state, `compute_logits` takes the rows that sample to logits."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) -> final-normed hidden states (T, hidden)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, hidden) rows of `forward`'s output -> (B, vocab) float32 logits."""
        raise NotImplementedError

    def compute_logits_raw(self, hidden: torch.Tensor) -> torch.Tensor:
        """`compute_logits` before the float32 cast (the head's output dtype): a CUDA graph's
        greedy argmax reads these, and the float32 copy is made only for a step that samples or
        wants logprobs. Models whose logits are float32 already need not override it."""
        return self.compute_logits(hidden)

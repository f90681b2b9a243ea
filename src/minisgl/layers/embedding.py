"""Token embedding (replicated on every rank) and the LM head (vocab-parallel over ranks)."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.backends import OpsUser
from minisgl.distributed import DistributedInfo
from minisgl.layers.tp import all_gather_last_dim


class Embedding(nn.Module, OpsUser):
    """The whole (vocab, hidden) table on each rank: a lookup is cheap and needs no communication.
    `weight` is a tensor, or a QuantizedWeight (a checkpoint's format kept) the ops backend reads."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        return self.ops.embedding(ids, self.weight)


def vocab_shard(vocab_size: int, tp: DistributedInfo) -> tuple[int, int, int]:
    """(start, rows this rank holds, padded rows per rank): the last shard is zero-padded to equal width."""
    per_rank = -(-vocab_size // tp.size)
    start = per_rank * tp.rank
    return start, max(0, min(per_rank, vocab_size - start)), per_rank


class LMHead(nn.Module, OpsUser):
    """hidden -> float32 logits. With N ranks each holds ceil(V/N) vocab rows; the logits are all-gathered."""

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        tp: DistributedInfo,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        _, _, rows = vocab_shard(vocab_size, tp)
        # Zeros so that padding rows of the last shard give finite (then discarded) logits.
        self.weight = nn.Parameter(torch.zeros(rows, hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, hidden) -> (B, vocab) float32
        logits = all_gather_last_dim(self.ops.linear(h, self.weight, None), self.tp)  # (B, N * rows)
        if logits.shape[-1] != self.vocab_size:
            logits = logits[:, : self.vocab_size]
        return logits.float()

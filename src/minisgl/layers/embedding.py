"""Token embedding (replicated on every rank) and the LM head (vocab-parallel over ranks)."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.backends import OpsUser
from minisgl.backends.fp8 import FP8, Fp8Weight
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
    """hidden -> float32 logits. With N ranks each holds ceil(V/N) vocab rows; the logits are all-gathered.
    In fp8 only where asked for (`to_fp8`, `--quantization fp8_lm_head`)."""

    fp8: Fp8Weight | None = None  # set by `to_fp8`

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
        _, held, rows = vocab_shard(vocab_size, tp)
        weight = torch.empty(rows, hidden, dtype=dtype, device=device)  # untouched until loaded
        weight[held:].zero_()  # the last shard's padding rows: finite (then discarded) logits
        self.weight = nn.Parameter(weight, requires_grad=False)

    @property
    def w(self) -> torch.Tensor | Fp8Weight:
        """The weight as the ops take it: the parameter, or the fp8 weight with its scales."""
        return self.weight if self.fp8 is None else self.fp8

    def to_fp8(self) -> None:
        """Hold the head in fp8 with one float32 scale per vocab row (`weight_scale`), filled by the
        loader, which quantizes the checkpoint's rows; the padding rows stay zero."""
        rows, hidden = self.weight.shape
        _, held, _ = vocab_shard(self.vocab_size, self.tp)
        weight = torch.empty(rows, hidden, dtype=FP8, device=self.weight.device)
        weight[held:].zero_()
        self.weight = nn.Parameter(weight, requires_grad=False)
        scale = torch.ones(rows, dtype=torch.float32, device=weight.device)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.fp8 = Fp8Weight(self.weight, self.weight_scale, None)

    def forward(self, h: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """(B, hidden) -> (B, vocab) float32 logits (upcast=False: in the linear's output dtype)."""
        logits = all_gather_last_dim(self.ops.lm_head(h, self.w), self.tp)  # (B, N * rows)
        if logits.shape[-1] != self.vocab_size:
            logits = logits[:, : self.vocab_size]
        return logits.float() if upcast else logits.contiguous()

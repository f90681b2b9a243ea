"""What a forward step reads and multiplies, for the benchmarks' floors: a dense model reads every
weight once per step; a mixture of experts reads its routed experts only as far as the step's tokens
reach them (batch 1: its top-k experts per layer; a large batch: most of them).

Under uniform routing each token picks k of the E experts of a layer, so a given expert is missed by
one token with probability 1 - k/E, and by all B tokens of a step with (1 - k/E)^B: the step reads
E (1 - (1 - k/E)^B) experts per layer, on average."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


def expected_experts(num_experts: int, top_k: int, rows: float) -> float:
    """The expected number of distinct experts `rows` tokens reach, each routed to `top_k` of
    `num_experts` uniformly at random."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


@dataclass(frozen=True)
class WeightCounts:
    """A model's weights by how a step reads them (counts of elements, not bytes)."""

    layer: int  # the decoder layers' matrices every token multiplies (attention, dense MLPs, routers)
    head: int  # the LM head
    expert: int  # one routed expert's matrices, summed over the sparse layers (0: a dense model)
    other: int  # everything else a step reads once (norms, biases; the embedding when tied)
    num_experts: int = 0
    top_k: int = 0
    bytes_per_weight: int = 2

    @classmethod
    def of(cls, model: nn.Module) -> WeightCounts:
        """Counted from a minisgl model (its `SparseMoE` blocks hold the routed experts)."""
        from minisgl.layers import SparseMoE

        routed: set[int] = set()
        expert, num_experts, top_k = 0, 0, 0
        for m in model.modules():
            if isinstance(m, SparseMoE):
                routed.update((id(m.w13), id(m.w2)))
                expert += (m.w13[0].numel() + m.w2[0].numel()) if m.w13.shape[0] else 0
                num_experts, top_k = m.w13.shape[0], m.top_k
        head = model.lm_head.weight
        seen, layer, other = {id(head)}, 0, 0
        for name, p in model.named_parameters():
            if id(p) in seen or id(p) in routed or name == "model.embed_tokens.weight":
                continue  # the embedding table: a lookup reads a few rows (tied: it is the head)
            seen.add(id(p))
            if name.startswith("model.layers.") and p.dim() == 2:
                layer += p.numel()
            else:
                other += p.numel()
        return cls(layer, head.numel(), expert, other, num_experts, top_k, head.element_size())

    def active(self) -> int:
        """Matrix weights one token multiplies in the decoder layers (2 FLOPs each)."""
        return self.layer + self.top_k * self.expert

    def experts_read(self, rows: float) -> float:
        """Routed experts a step of `rows` tokens reads per sparse layer, on average."""
        return expected_experts(self.num_experts, self.top_k, rows)

    def read_bytes(self, rows: float) -> float:
        """Bytes of weights a step of `rows` tokens reads."""
        total = self.layer + self.head + self.other + self.expert * self.experts_read(rows)
        return total * self.bytes_per_weight

"""What a forward step reads and multiplies, for the benchmarks' floors: a dense model reads every
weight once per step; a mixture of experts reads its routed experts only as far as the step's tokens
reach them (batch 1: its top-k experts per layer; a large batch: most of them).

Under uniform routing each token picks k of the E experts of a layer, so a given expert is missed by
one token with probability 1 - k/E, and by all B tokens of a step with (1 - k/E)^B: the step reads
E (1 - (1 - k/E)^B) experts per layer, on average."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


def expected_experts(num_experts: int, top_k: int, rows: float) -> float:
    """The expected number of distinct experts `rows` tokens reach, each routed to `top_k` of
    `num_experts` uniformly at random."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


@dataclass(frozen=True)
class WeightCounts:
    """A model's weights by how a step reads them: counts of elements (for FLOPs) and bytes (for the
    bandwidth floor; a weight kept in a checkpoint's block format counts its blocks' bytes)."""

    layer: int  # the decoder layers' matrices every token multiplies (attention, dense MLPs, routers)
    head: int  # the LM head
    expert: int  # one routed expert's matrices, summed over the sparse layers (0: a dense model)
    other: int  # everything else a step reads once (norms, biases; the embedding when tied)
    num_experts: int = 0
    top_k: int = 0
    layer_bytes: int = 0
    head_bytes: int = 0
    expert_bytes: int = 0
    other_bytes: int = 0

    @classmethod
    def of(cls, model: nn.Module) -> WeightCounts:
        """Counted from a minisgl model (its `SparseMoE` blocks hold the routed experts)."""
        from minisgl.layers import SparseMoE

        routed: set[int] = set()
        expert, expert_bytes, num_experts, top_k = 0, 0, 0, 0
        for m in model.modules():
            if isinstance(m, SparseMoE):
                routed.update((id(m.w13), id(m.w2)))
                if m.w13.shape[0]:
                    expert += m.w13[0].numel() + m.w2[0].numel()
                    expert_bytes += (m.w13[0].numel() + m.w2[0].numel()) * m.w13.element_size()
                num_experts, top_k = m.w13.shape[0], m.top_k
        lm_head: Any = model.lm_head
        head = lm_head.weight
        head_n, head_b = _size(head)
        seen, counts = {id(head)}, {"layer": [0, 0], "other": [0, 0]}
        for name, w in _named_weights(model):
            if id(w) in seen or id(w) in routed or name == "model.embed_tokens.weight":
                continue  # the embedding table: a lookup reads a few rows (tied: it is the head)
            seen.add(id(w))
            matrix = len(w.shape) == 2 and not name.endswith("scale")  # (fp8 block scales are 2-D)
            kind = "layer" if name.startswith("model.layers.") and matrix else "other"
            n, b = _size(w)
            counts[kind][0] += n
            counts[kind][1] += b
        (layer, layer_b), (other, other_b) = counts["layer"], counts["other"]
        return cls(
            layer, head_n, expert, other, num_experts, top_k, layer_b, head_b, expert_bytes, other_b
        )  # fmt: skip

    def active(self) -> int:
        """Matrix weights one token multiplies in the decoder layers (2 FLOPs each)."""
        return self.layer + self.top_k * self.expert

    def experts_read(self, rows: float) -> float:
        """Routed experts a step of `rows` tokens reads per sparse layer, on average."""
        return expected_experts(self.num_experts, self.top_k, rows)

    def read_bytes(self, rows: float) -> float:
        """Bytes of weights a step of `rows` tokens reads."""
        dense = self.layer_bytes + self.head_bytes + self.other_bytes
        return dense + self.expert_bytes * self.experts_read(rows)


def _named_weights(model: nn.Module) -> list[tuple[str, Any]]:
    """Every parameter, and every QuantizedWeight a module holds in a parameter's place, by name."""
    from minisgl.quant import QuantizedWeight

    out: list[tuple[str, Any]] = []
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        out += [(prefix + n, p) for n, p in mod.named_parameters(recurse=False)]
        out += [(prefix + n, v) for n, v in vars(mod).items() if isinstance(v, QuantizedWeight)]
    return out


def _size(w: Any) -> tuple[int, int]:
    """(elements, bytes) of a parameter or a QuantizedWeight."""
    from minisgl.quant import QuantizedWeight

    if isinstance(w, QuantizedWeight):
        return w.shape[0] * w.shape[1], w.nbytes
    return w.numel(), w.numel() * w.element_size()

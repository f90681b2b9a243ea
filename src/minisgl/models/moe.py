"""Where a mixture-of-experts checkpoint's tensors go: per-expert tensors stacked into the block's
(E, 2I/N, H) and (E, H, I/N) parameters as they load, each rank reading only its slice of every
expert's intermediate dimension (`SparseMoE` in minisgl.layers.moe)."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.layers import SparseMoE
from minisgl.models.config import MoEConfig
from minisgl.models.weights import WeightSlot, swiglu_slots, whole


@dataclass(frozen=True)
class ExpertNames:
    """A family's checkpoint names under `model.layers.N.`: the block, and each expert's gate, up
    and down projections under `<block>.experts.<e>.`."""

    block: str
    gate: str
    up: str
    down: str


_QWEN = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
EXPERT_NAMES = {
    "mixtral": ExpertNames("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": _QWEN,
    "qwen3_moe": _QWEN,
}


def moe_slots(
    prefix: str, block: SparseMoE, moe: MoEConfig, family: str, hidden: int, rank: int
) -> dict[str, list[WeightSlot]]:
    """The slots of one sparse layer's checkpoint tensors (`prefix`: "model.layers.N.")."""
    names = EXPERT_NAMES[family]
    b = f"{prefix}{names.block}."
    s: dict[str, list[WeightSlot]] = {f"{b}gate.weight": [whole(block.router)]}
    for e in range(moe.num_experts):
        x = f"{b}experts.{e}."
        proj = (f"{x}{names.gate}.weight", f"{x}{names.up}.weight", f"{x}{names.down}.weight")
        s.update(swiglu_slots(proj, block.w13[e], block.w2[e], moe.intermediate_size, hidden, rank))
    if block.shared is not None:
        x = f"{b}shared_expert."
        proj = (f"{x}gate_proj.weight", f"{x}up_proj.weight", f"{x}down_proj.weight")
        sh = block.shared
        s.update(
            swiglu_slots(
                proj, sh.gate_up_proj.weight, sh.down_proj.weight, moe.shared_intermediate_size, hidden, rank
            )
        )
        s[f"{b}shared_expert_gate.weight"] = [whole(sh.gate.weight)]
    return s

"""Where a mixture-of-experts checkpoint's tensors go: per-expert tensors stacked into the block's
(E, 2I/N, H) and (E, H, I/N) parameters as they load, each rank reading only its slice of every
expert's intermediate dimension (`SparseMoE` in minisgl.layers.moe)."""

from __future__ import annotations

from minisgl.checkpoint.weights import EXPERT_NAMES, WeightSlot, swiglu_slots, whole
from minisgl.layers import SparseMoE
from minisgl.models.config import MoEConfig


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

"""The mixture-of-experts part of reading a GGUF file (llama.cpp's `qwen3moe`, `qwen2moe`, and `llama`
with experts, which is Mixtral): the config fields from the metadata, and the names of the MoE tensors.

llama.cpp stacks each layer's experts into one tensor per projection: `ffn_gate_exps` / `ffn_up_exps`
(E, I, H) and `ffn_down_exps` (E, H, I) in numpy's order, expert e being `[e]`, i.e. rows
[e * r, (e + 1) * r) of the 2-D (E * r, c) view (ggml quantizes row by row, so that is also a range of
whole quantized rows). The router is `ffn_gate_inp` (E, H); Qwen2-MoE's shared expert is
`ffn_{gate,up,down}_shexp` with its gate `ffn_gate_inp_shexp` (H,), which Hugging Face keeps as (1, H).
"""

from __future__ import annotations

import re
from typing import Any

from minisgl.checkpoint.weights import EXPERT_NAMES

# GGUF architecture -> the Hugging Face architecture of its MoE models
MOE_ARCHITECTURES = {
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "llama": "MixtralForCausalLM",
}
_FAMILIES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}
# llama.cpp's graphs divide the top-k weights by their sum for these (when the file does not say)
_NORM_TOPK = {"qwen3moe": True, "qwen2moe": False, "llama": True}
_STACKED = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_SHARED = {
    "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",
}


def is_moe(meta: dict[str, Any], arch: str) -> bool:
    """Whether a GGUF file of architecture `arch` holds a mixture of experts."""
    return arch in MOE_ARCHITECTURES and int(meta.get(f"{arch}.expert_count") or 0) > 0


def moe_config(meta: dict[str, Any], arch: str, tensor_names: set[str], num_layers: int) -> dict[str, Any]:
    """config.json fields of a MoE file, as transformers names them (over the dense ones)."""

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hf_arch = MOE_ARCHITECTURES[arch]
    experts, top_k = int(get("expert_count")), int(get("expert_used_count"))
    fields: dict[str, Any] = {"architectures": [hf_arch], "num_experts_per_tok": top_k}
    if hf_arch == "MixtralForCausalLM":
        return fields | {"model_type": "mixtral", "num_local_experts": experts}
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    fields |= {
        "model_type": "qwen3_moe" if arch == "qwen3moe" else "qwen2_moe",
        "num_experts": experts,
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "norm_topk_prob": bool(get("expert_weights_norm", _NORM_TOPK[arch])),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,  # the blocks without a router
    }
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0))
        fields["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
    return fields


def moe_tensor_names(name: str, hf_arch: str, num_experts: int) -> list[str] | None:
    """The Hugging Face names of GGUF MoE tensor `name`: for a stacked expert tensor, the name of each
    expert in order (expert e is `[e]`); else one name. None: not an MoE tensor."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    family = _FAMILIES.get(hf_arch)
    if m is None or family is None:
        return None
    names, part = EXPERT_NAMES[family], m.group(2)
    block = f"model.layers.{m.group(1)}.{names.block}"
    if part == "ffn_gate_inp":
        return [f"{block}.gate.weight"]
    if part in _STACKED:
        proj = getattr(names, _STACKED[part])
        return [f"{block}.experts.{e}.{proj}.weight" for e in range(num_experts)]
    if part in _SHARED and family == "qwen2_moe":
        return [f"{block}.{_SHARED[part]}.weight"]
    return None

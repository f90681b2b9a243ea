"""The decoder-only transformer of Llama and its relatives (Mistral, Qwen2 with q/k/v bias, Qwen3 with
per-head q/k RMSNorm; Mixtral, Qwen2-MoE and Qwen3-MoE, whose sparse layers put routed experts in place
of the MLP: `SparseMoE`), over a flattened batch of tokens from many requests.

q/k/v and gate/up are fused into one matmul each at load time. Under tensor parallelism (applied
when the model is built: each rank allocates only its shard) attention heads and the MLP's
intermediate width are split column-wise, o_proj/down_proj row-wise with an all-reduce, and the
LM head over the vocabulary with an all-gather of the logits."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from minisgl.backends import OpsUser
from minisgl.checkpoint.weights import WeightSlot, swiglu_slots, whole
from minisgl.distributed import DistributedInfo
from minisgl.layers import (
    AttentionLayer,
    Embedding,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SparseMoE,
    vocab_shard,
)
from minisgl.models.base import CausalLM
from minisgl.models.config import ModelConfig
from minisgl.models.moe import moe_slots

Device = torch.device | str


class HeadLayout:
    """Which q and kv heads this rank holds. kv heads are replicated when there are fewer than ranks."""

    def __init__(self, cfg: ModelConfig, tp: DistributedInfo) -> None:
        n = tp.size
        if cfg.num_heads % n:
            raise ValueError(
                f"num_attention_heads {cfg.num_heads} is not divisible by tensor-parallel size {n}"
            )
        if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            raise ValueError(
                f"num_key_value_heads {cfg.num_kv_heads} and tensor-parallel size {n}: one must divide the other"
            )
        for name, size in _sharded_widths(cfg):
            if size % n:
                raise ValueError(f"{name} {size} is not divisible by tensor-parallel size {n}")
        self.num_heads = cfg.num_heads // n
        self.q_start = tp.rank * self.num_heads
        if cfg.num_kv_heads >= n:
            self.num_kv_heads = cfg.num_kv_heads // n
            self.kv_start = tp.rank * self.num_kv_heads
        else:  # each kv head serves n / Hkv ranks
            self.num_kv_heads = 1
            self.kv_start = tp.rank // (n // cfg.num_kv_heads)


def _sharded_widths(cfg: ModelConfig) -> list[tuple[str, int]]:
    """The intermediate widths the model splits over ranks (config field name, size)."""
    moe, layers = cfg.moe, range(cfg.num_layers)
    dense = moe is None or not all(moe.is_sparse(i) for i in layers)
    widths = [("intermediate_size", cfg.intermediate_size)] if dense else []
    if moe is not None:
        widths.append(("the experts' intermediate size", moe.intermediate_size))
        if moe.shared_intermediate_size:
            widths.append(("shared_expert_intermediate_size", moe.shared_intermediate_size))
    return widths


class Attention(nn.Module, OpsUser):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        heads: HeadLayout,
        tp: DistributedInfo,
        dtype: torch.dtype,
        device: Device,
    ) -> None:
        super().__init__()
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, d
        self.qkv_proj = Linear(
            cfg.hidden_size, (heads.num_heads + 2 * heads.num_kv_heads) * d, cfg.attention_bias, dtype, device
        )
        self.o_proj = RowParallelLinear(
            heads.num_heads * d, cfg.hidden_size, cfg.o_proj_bias, tp, dtype, device
        )
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.qk_norm = cfg.qk_norm
        self.attn = AttentionLayer(layer_id, heads.num_heads, heads.num_kv_heads, d)

    def forward(self, h: torch.Tensor, norm: RMSNorm, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        """h (T, hidden), the residual stream: `h += attention(norm(h))` in place. rope: (cos, sin)."""
        t, d = h.shape[0], self.head_dim
        qkv = self.qkv_proj.forward_normed(h, norm)  # (T, (Hq + 2 Hkv) D)
        # Qwen3: a per-head RMSNorm of q and k before RoPE. The attention backend may norm and rotate
        # inside its own kernel (Triton's decode); else `rope_qkv` norms, rotates and splits in one
        # (on CUDA one kernel; torch's rotate-half and the norms were ~16 small kernels a layer).
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
        cos, sin = rope  # (T, 1, D/2) each
        split = partial(
            self.ops.rope_qkv, cos=cos, sin=sin, hq=self.num_heads, hkv=self.num_kv_heads, d=d, qk_norm=norms
        )
        o = self.attn.forward_rope(qkv, rope, split, norms)  # (T, Hq, D)
        self.o_proj.forward_add_(o.reshape(t, self.num_heads * d), h)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: DistributedInfo, dtype: torch.dtype, device: Device) -> None:
        super().__init__()
        inter = cfg.intermediate_size // tp.size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, False, dtype, device)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, tp, dtype, device)

    def forward(self, h: torch.Tensor, norm: RMSNorm) -> None:
        """`h += mlp(norm(h))` in place, h (T, hidden): SwiGLU over the fused gate/up projection."""
        self.down_proj.forward_swiglu_add_(self.gate_up_proj, h, norm, h)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        heads: HeadLayout,
        tp: DistributedInfo,
        dtype: torch.dtype,
        device: Device,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, layer_id, heads, tp, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        moe = cfg.moe
        self.mlp: MLP | SparseMoE
        if moe is not None and moe.is_sparse(layer_id):
            self.mlp = SparseMoE(
                cfg.hidden_size, moe.num_experts, moe.intermediate_size, moe.top_k, moe.norm_topk_prob,
                moe.shared_intermediate_size, tp, dtype, device,
            )  # fmt: skip
        else:
            self.mlp = MLP(cfg, tp, dtype, device)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        """h (T, hidden), the residual stream, updated in place (it is this forward's own activation:
        the embedding lookup makes a new tensor). Each norm goes with the projection after it and
        each residual add with the projection before it, so a backend can fuse both."""
        self.self_attn(h, self.input_layernorm, rope)
        self.mlp(h, self.post_attention_layernorm)


class DecoderModel(nn.Module):
    """The `model.` part of the checkpoint: embedding, layers, final norm."""

    def __init__(
        self, cfg: ModelConfig, heads: HeadLayout, tp: DistributedInfo, dtype: torch.dtype, device: Device
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, heads, tp, dtype, device) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class LlamaForCausalLM(CausalLM):
    """Runs Llama, Mistral, Qwen2, Qwen3 and their mixture-of-experts relatives (Mixtral, Qwen2-MoE,
    Qwen3-MoE): the differences are flags in ModelConfig."""

    def __init__(self, cfg: ModelConfig, tp: DistributedInfo, dtype: torch.dtype, device: Device) -> None:
        super().__init__()
        self.config, self.tp, self.dtype = cfg, tp, dtype
        self.heads = HeadLayout(cfg, tp)
        self.num_local_heads, self.num_local_kv_heads = self.heads.num_heads, self.heads.num_kv_heads
        self.head_dim, self.num_layers = cfg.head_dim, cfg.num_layers
        self.model = DecoderModel(cfg, self.heads, tp, dtype, device)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        if cfg.tie_word_embeddings and tp.size == 1:
            self.lm_head.weight = self.model.embed_tokens.weight  # one tensor, no copy
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, dtype, device
        )

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) of a flattened batch -> final-normed hidden states (T, hidden)."""
        h = self.model.embed_tokens(input_ids)  # (T, hidden)
        rope = self.rotary.lookup(positions)  # (T, 1, D/2) cos and sin
        for layer in self.model.layers:
            layer(h, rope)
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, hidden) rows of `forward`'s output -> (B, vocab) float32 logits."""
        return self.lm_head(hidden)

    @torch.inference_mode()
    def compute_logits_raw(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits in the head's output dtype (`compute_logits` without the float32 cast)."""
        return self.lm_head(hidden, upcast=False)

    # ---------------------------------------------------------------------------------------------
    # Where each checkpoint tensor goes (see weights.py)

    def checkpoint_ignored(self) -> set[str]:
        """Tensors a checkpoint may carry that this model does not use."""
        return {"lm_head.weight"} if self.config.tie_word_embeddings else set()

    def weight_slots(self) -> dict[str, list[WeightSlot]]:
        cfg, tp = self.config, self.tp
        slots: dict[str, list[WeightSlot]] = {
            "model.embed_tokens.weight": [whole(self.model.embed_tokens.weight)],
            "model.norm.weight": [whole(self.model.norm.weight)],
        }
        v_start, v_rows, _ = vocab_shard(cfg.vocab_size, tp)
        full = (cfg.vocab_size, cfg.hidden_size)
        head_slot = WeightSlot(self.lm_head.weight, full, 0, v_start, v_rows)
        if not cfg.tie_word_embeddings:
            slots["lm_head.weight"] = [head_slot]
        elif tp.size > 1:
            slots["model.embed_tokens.weight"].append(head_slot)
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer)  # (a ModuleList's items are typed as Module)
            slots.update(self._layer_slots(f"model.layers.{i}.", layer))
        return slots

    def _layer_slots(self, prefix: str, layer: DecoderLayer) -> dict[str, list[WeightSlot]]:
        cfg, hl, d, hidden = self.config, self.heads, self.config.head_dim, self.config.hidden_size
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [  # (name, full heads, first local head, local heads, row offset in the fused weight)
            ("q_proj", cfg.num_heads, hl.q_start, hl.num_heads, 0),
            ("k_proj", cfg.num_kv_heads, hl.kv_start, hl.num_kv_heads, hl.num_heads * d),
            ("v_proj", cfg.num_kv_heads, hl.kv_start, hl.num_kv_heads, (hl.num_heads + hl.num_kv_heads) * d),
        ]
        s: dict[str, list[WeightSlot]] = {}
        for name, full, first, n, dst in qkv:
            p = f"{prefix}self_attn.{name}."
            s[p + "weight"] = [WeightSlot(attn.qkv_proj.weight, (full * d, hidden), 0, first * d, n * d, dst)]
            if cfg.attention_bias:
                s[p + "bias"] = [WeightSlot(_bias(attn.qkv_proj), (full * d,), 0, first * d, n * d, dst)]
        o = f"{prefix}self_attn.o_proj."
        s[o + "weight"] = [
            WeightSlot(attn.o_proj.weight, (hidden, cfg.num_heads * d), 1, hl.q_start * d, hl.num_heads * d)
        ]
        if cfg.o_proj_bias:
            s[o + "bias"] = [whole(_bias(attn.o_proj))]
        if cfg.qk_norm:
            s[f"{prefix}self_attn.q_norm.weight"] = [whole(attn.q_norm.weight)]
            s[f"{prefix}self_attn.k_norm.weight"] = [whole(attn.k_norm.weight)]
        if isinstance(mlp, SparseMoE):
            assert cfg.moe is not None
            s.update(moe_slots(prefix, mlp, cfg.moe, cfg.family, hidden, self.tp.rank))
        else:
            m = f"{prefix}mlp."
            names = (f"{m}gate_proj.weight", f"{m}up_proj.weight", f"{m}down_proj.weight")
            w13, w2 = mlp.gate_up_proj.weight, mlp.down_proj.weight
            s.update(swiglu_slots(names, w13, w2, cfg.intermediate_size, hidden, self.tp.rank))
        s[f"{prefix}input_layernorm.weight"] = [whole(layer.input_layernorm.weight)]
        s[f"{prefix}post_attention_layernorm.weight"] = [whole(layer.post_attention_layernorm.weight)]
        return s


def _bias(linear: Linear) -> torch.Tensor:
    """The bias of a linear layer the config gave one (attention_bias, o_proj_bias)."""
    if linear.bias is None:
        raise ValueError("this linear layer has no bias")
    return linear.bias

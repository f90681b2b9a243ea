"""minisgl.layers: the building blocks of the models (norms, rotary, linears, embeddings, attention,
mixtures of experts)."""

from minisgl.layers.attention import AttentionLayer
from minisgl.layers.embedding import Embedding, LMHead, vocab_shard
from minisgl.layers.linear import Linear, RowParallelLinear
from minisgl.layers.moe import SharedExpert, SparseMoE
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding, rope_inv_freq

__all__ = [
    "AttentionLayer",
    "Embedding",
    "LMHead",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SharedExpert",
    "SparseMoE",
    "rope_inv_freq",
    "vocab_shard",
]

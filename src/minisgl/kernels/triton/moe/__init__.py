"""Mixture-of-experts kernels: the router's softmax and top-k by one exact tie rule (`route`), the
fused MoE over the token-expert pairs sorted by expert, its routing and alignment in one launch at
decode sizes (`fused`), and one token's experts as row GEMVs on the CUDA cores (`experts`, opt-in)."""

from .fused import (
    ROUTE_IN_ALIGN,
    MoeConfig,
    align_pairs,
    down_config,
    fused_moe,
    moe_config,
    route_and_align,
    routed_moe,
    routed_moe_from_router,
)
from .route import route_topk

__all__ = [
    "ROUTE_IN_ALIGN",
    "MoeConfig",
    "align_pairs",
    "down_config",
    "fused_moe",
    "moe_config",
    "route_and_align",
    "route_topk",
    "routed_moe",
    "routed_moe_from_router",
]

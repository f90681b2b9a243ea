"""The router's choice in one Triton launch: a float32 softmax over each token's E router logits, its
top-k experts and their weights (divided by their sum when renormalizing).

The tie rule, documented and exact: the k largest probabilities in descending order, and among equal
probabilities the lower expert index first (what a stable descending sort gives). torch.topk, which
transformers uses, picks among exactly tied values in an order that depends on its kernel and device;
the CUDA backend follows this rule instead (the reference backends keep torch.topk's choice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def topk_row(
    Logits,
    Weights,
    Ids,
    t,
    e,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Token t: its E logits at Logits -> its top-k weights and expert ids stored at t * TOP_K."""
    experts = tl.arange(0, E_PAD)
    logits = tl.load(Logits + experts, mask=experts < e, other=-float("inf")).to(tl.float32)
    z = tl.exp(logits - tl.max(logits, 0))  # padding: exp(-inf) = 0
    probs = z / tl.sum(z, 0)  # (E_PAD,)
    slots = tl.arange(0, K_PAD)
    chosen_p = tl.zeros([K_PAD], tl.float32)
    chosen_e = tl.zeros([K_PAD], tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        idx = tl.min(tl.where(probs == best, experts, E_PAD), 0)  # ties: the lower index
        chosen_p = tl.where(slots == j, best, chosen_p)
        chosen_e = tl.where(slots == j, idx.to(tl.int64), chosen_e)
        probs = tl.where(experts == idx, -1.0, probs)  # taken
    if RENORMALIZE:
        chosen_p = chosen_p / tl.sum(tl.where(slots < TOP_K, chosen_p, 0.0), 0)
    out = t * TOP_K + slots
    tl.store(Weights + out, chosen_p, mask=slots < TOP_K)
    tl.store(Ids + out, chosen_e, mask=slots < TOP_K)


@triton.jit
def _route_kernel(
    Logits,  # (T, E), unit stride in E
    Weights,  # (T, TOP_K) float32 out
    Ids,  # (T, TOP_K) int64 out
    e,
    stride_l,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    topk_row(Logits + t * stride_l, Weights, Ids, t, e, TOP_K, K_PAD, E_PAD, RENORMALIZE)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E), unit stride in E -> weights (T, K) float32 and ids (T, K) int64: the
    float32 softmax's top-k (ties: the lower expert index first), divided by their sum when
    `renormalize`. One program per token, no host sync."""
    t, e = logits.shape
    if logits.stride(1) != 1 or not 0 < top_k <= e:
        raise ValueError(f"route_topk: logits {tuple(logits.shape)} strides {logits.stride()}, top-k {top_k}")
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    e_pad = triton.next_power_of_2(e)
    _route_kernel[(t,)](
        logits, weights, ids, e, logits.stride(0), TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)),
        E_PAD=e_pad, RENORMALIZE=renormalize, num_warps=1 if e_pad <= 128 else 4,
    )  # fmt: skip
    return weights, ids

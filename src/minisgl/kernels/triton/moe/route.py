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
def topk_tile(
    logits,  # (BLOCK_T, E_PAD) float32, -inf past the experts
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """-> each row's top-k probabilities (BLOCK_T, K_PAD) float32 and expert ids (BLOCK_T, K_PAD) int64,
    slots past TOP_K unused: the float32 softmax, ties to the lower index, divided by their sum when
    RENORMALIZE."""
    experts = tl.arange(0, E_PAD)
    z = tl.exp(logits - tl.max(logits, 1)[:, None])  # padding: exp(-inf) = 0 (a masked row: NaN, unused)
    probs = z / tl.sum(z, 1)[:, None]
    slots = tl.arange(0, K_PAD)
    chosen_p = tl.zeros([logits.shape[0], K_PAD], tl.float32)
    chosen_e = tl.zeros([logits.shape[0], K_PAD], tl.int64)
    # One reduction a slot: a probability (>= +0, so its bits order as it does) in the high word and
    # the expert's index reversed in the low one, so the largest key is the largest probability and,
    # among equal ones, the lower index; a taken expert's key is -1.
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    keys = (bits << 32) | (E_PAD - 1 - experts)[None, :].to(tl.int64)
    for j in tl.static_range(TOP_K):
        top = tl.max(keys, 1)  # (BLOCK_T,)
        idx = E_PAD - 1 - (top & 0xFFFFFFFF)  # int64
        best = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        chosen_p = tl.where(slots[None, :] == j, best[:, None], chosen_p)
        chosen_e = tl.where(slots[None, :] == j, idx[:, None], chosen_e)
        keys = tl.where(keys == top[:, None], -1, keys)  # taken (keys are distinct within a row)
    if RENORMALIZE:
        chosen_p = chosen_p / tl.sum(tl.where(slots[None, :] < TOP_K, chosen_p, 0.0), 1)[:, None]
    return chosen_p, chosen_e


@triton.jit
def topk_rows(
    Logits,  # (T, E), unit stride in E
    Weights,  # (T, TOP_K) float32 out
    Ids,  # (T, TOP_K) int64 out
    t0,
    t,
    e,
    stride_l,
    BLOCK_T: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Tokens t0 .. t0 + BLOCK_T - 1 (of t): their top-k weights and expert ids, all at once."""
    rows = t0 + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    row_mask = rows < t
    experts = tl.arange(0, E_PAD)
    ptrs = Logits + rows[:, None].to(tl.int64) * stride_l + experts[None, :]
    mask = row_mask[:, None] & (experts < e)[None, :]
    logits = tl.load(ptrs, mask=mask, other=-float("inf")).to(tl.float32)  # (BLOCK_T, E_PAD)
    chosen_p, chosen_e = topk_tile(logits, TOP_K, K_PAD, E_PAD, RENORMALIZE)
    slots = tl.arange(0, K_PAD)
    out = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    out_mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    tl.store(Weights + out, chosen_p, mask=out_mask)
    tl.store(Ids + out, chosen_e, mask=out_mask)


@triton.jit
def _route_kernel(
    Logits,  # (T, E), unit stride in E
    Weights,  # (T, TOP_K) float32 out
    Ids,  # (T, TOP_K) int64 out
    t,
    e,
    stride_l,
    BLOCK_T: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t0 = tl.program_id(0) * BLOCK_T
    topk_rows(Logits, Weights, Ids, t0, t, e, stride_l, BLOCK_T, TOP_K, K_PAD, E_PAD, RENORMALIZE)


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
    block_t = max(1, min(16, 2048 // e_pad))  # tokens per program
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, weights, ids, t, e, logits.stride(0), BLOCK_T=block_t, TOP_K=top_k,
        K_PAD=max(2, triton.next_power_of_2(top_k)), E_PAD=e_pad, RENORMALIZE=renormalize, num_warps=4,
    )  # fmt: skip
    return weights, ids

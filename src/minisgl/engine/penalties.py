"""Penalties and biases on a batch's logits, as vLLM defines them, in batched torch ops on the
logits' device (no host sync):

- `logit_bias`: added to the logits of the given token ids;
- `min_tokens`: EOS and the request's stop token ids get -inf while fewer tokens were generated;
- `repetition_penalty` r (HF/vLLM): each token seen in the prompt or the output has its logit divided
  by r when positive and multiplied by r when negative;
- `frequency_penalty` f and `presence_penalty` p (OpenAI): logit -= f * count + p * (count > 0), the
  count over the generated tokens only.

The counts are rebuilt every step from the request's tokens (host lists, copied once per step) plus,
with overlap scheduling, the token the previous step sampled that the host has not seen yet (given
on the device). Nothing is kept between steps, so retraction and tensor parallelism need no care.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minisgl.core import Req
from minisgl.utils.transfer import to_device


def apply_penalties(
    logits: torch.Tensor,  # (n, V) float32, modified in place
    reqs: Sequence[Req],
    eos_ids: Sequence[int],
    pending: torch.Tensor | None = None,  # (n,) int64 on the device: each row's unseen token, -1: none
) -> torch.Tensor:
    """Apply every request's penalties and biases to its row of `logits`; returns `logits`."""
    n, vocab = logits.shape
    dev = logits.device
    params = [r.sampling_params for r in reqs]
    _add_bias(logits, [p.logit_bias for p in params])
    generated = [r.output_len + r.pending for r in reqs]  # pending: sampled, not seen by the host yet
    _suppress_stops(
        logits,
        [
            list(eos_ids) + p.stop_token_ids if g < p.min_tokens else []
            for p, g in zip(params, generated, strict=True)
        ],
    )
    rep = [p.repetition_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    if all(r == 1.0 for r in rep) and not any(freq) and not any(pres):
        return logits
    counts = _counts(n, vocab, [r.output_ids for r in reqs], pending, dev)  # (n, V) float32
    f32 = torch.float32
    if any(r != 1.0 for r in rep):
        seen = _counts(n, vocab, [r.token_ids[: r.prompt_len] for r in reqs], None, dev) + counts > 0
        r_t = to_device(rep, dev, f32)[:, None].expand_as(logits)  # (n, V)
        scaled = torch.where(logits > 0, logits / r_t, logits * r_t)
        logits.copy_(torch.where(seen, scaled, logits))
    f_t = to_device(freq, dev, f32)[:, None]  # (n, 1)
    p_t = to_device(pres, dev, f32)[:, None]
    logits.sub_(f_t * counts + p_t * (counts > 0).to(f32))
    return logits


def _add_bias(logits: torch.Tensor, biases: list[dict[int, float]]) -> None:
    rows = [i for i, b in enumerate(biases) for _ in b]
    if not rows:
        return
    ids = [t for b in biases for t in b]
    values = [v for b in biases for v in b.values()]
    dev = logits.device
    index = (to_device(rows, dev, torch.int64), to_device(ids, dev, torch.int64))
    logits.index_put_(index, to_device(values, dev, logits.dtype), accumulate=True)


def _suppress_stops(logits: torch.Tensor, stops: list[list[int]]) -> None:
    rows = [i for i, s in enumerate(stops) for _ in s]
    if not rows:
        return
    dev = logits.device
    index = (to_device(rows, dev, torch.int64), to_device([t for s in stops for t in s], dev, torch.int64))
    logits.index_put_(index, to_device(float("-inf"), dev, logits.dtype))


def _counts(
    n: int, vocab: int, ids: list[list[int]], pending: torch.Tensor | None, dev: torch.device
) -> torch.Tensor:
    """(n, V) float32: how often each token occurs in each row's `ids` (+ its pending token)."""
    counts = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
    rows = [i for i, x in enumerate(ids) for _ in x]
    if rows:
        index = (to_device(rows, dev, torch.int64), to_device([t for x in ids for t in x], dev, torch.int64))
        counts.index_put_(index, torch.ones(len(rows), device=dev), accumulate=True)
    if pending is not None:
        valid = (pending >= 0).to(torch.float32)  # (n,)
        counts.scatter_add_(1, pending.clamp(min=0)[:, None], valid[:, None])
    return counts

"""Penalties and biases (engine/penalties.py) against their definitions, row by row, and the engine's
raw logprobs against a log-softmax of the logits."""

from __future__ import annotations

import torch

from minisgl.core import Req, SamplingParams
from minisgl.engine.logprobs import LogprobTensors
from minisgl.engine.penalties import apply_penalties

V = 12
EOS = [11]


def req(prompt: list[int], output: list[int], pending: int = 0, **kw: object) -> Req:
    r = Req(uid=0, token_ids=prompt + output, sampling_params=SamplingParams(**kw), prompt_len=len(prompt))
    r.pending = pending
    return r


def reference(logits: torch.Tensor, r: Req, unseen: int | None = None) -> torch.Tensor:
    """One row by the definitions, token by token."""
    p = r.sampling_params
    out = logits.clone()
    for t, b in p.logit_bias.items():
        out[t] += b
    outputs = r.output_ids + ([unseen] if unseen is not None else [])
    if len(outputs) < p.min_tokens:
        for t in EOS + p.stop_token_ids:
            out[t] = float("-inf")
    seen = set(r.token_ids[: r.prompt_len]) | set(outputs)
    for t in range(V):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = outputs.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_each_row_follows_the_definitions() -> None:
    torch.manual_seed(0)
    reqs = [
        req([1, 2, 3], [4, 4, 5], frequency_penalty=0.7),
        req([1, 2, 3], [4, 4, 5], presence_penalty=-1.5),
        req([1, 2, 3], [4, 4, 5], repetition_penalty=1.8),
        req([6], [], logit_bias={0: 100.0, 7: -3.5}),
        req([6], [7], min_tokens=3, stop_token_ids=[2]),
        req([1, 9], [9, 9, 9], frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=0.5),
    ]
    logits = torch.randn(len(reqs), V) * 3
    got = apply_penalties(logits.clone(), reqs, EOS)
    for i, r in enumerate(reqs):
        torch.testing.assert_close(got[i], reference(logits[i], r), msg=f"row {i}")


def test_min_tokens_ends_when_reached_and_zero_penalties_change_nothing() -> None:
    logits = torch.randn(2, V)
    done = req([1], [3, 4, 5], min_tokens=3)
    plain = req([1, 2], [2, 2], presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    torch.testing.assert_close(apply_penalties(logits.clone(), [done, plain], EOS), logits)


def test_the_unseen_pending_token_counts() -> None:
    """Overlap scheduling: the previous step's token is on the device only; it counts like the others."""
    logits = torch.randn(2, V)
    reqs = [
        req([1], [4], pending=1, frequency_penalty=1.0, min_tokens=2),
        req([1], [4], frequency_penalty=1.0),
    ]
    got = apply_penalties(logits.clone(), reqs, EOS, pending=torch.tensor([4, -1]))
    torch.testing.assert_close(got[0], reference(logits[0], reqs[0], unseen=4))
    torch.testing.assert_close(got[1], reference(logits[1], reqs[1]))
    assert got[0, 11] > float("-inf")  # 2 tokens generated with the pending one: EOS allowed again


def test_logprobs_are_the_raw_log_softmax_sorted() -> None:
    logits = torch.randn(3, V) * 4
    chosen = torch.tensor([0, 5, 11])
    lp = LogprobTensors.of(logits, chosen, 4)
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(lp.logprobs, ref.gather(1, chosen[:, None]).squeeze(1))
    [a, b] = lp.split([2, 1], [4, 2])
    assert len(a) == 2 and len(b) == 1 and len(b.top_ids[0]) == 2
    for row, (ids, vals) in enumerate(
        zip(a.top_ids + b.top_ids, a.top_logprobs + b.top_logprobs, strict=True)
    ):
        assert vals == sorted(vals, reverse=True)
        assert ids[0] == int(logits[row].argmax())
        torch.testing.assert_close(torch.tensor(vals), ref[row, ids])

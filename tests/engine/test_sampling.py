"""The sampler on synthetic logits: greedy, top-k, top-p, temperature, seeds, mixed batches."""

from __future__ import annotations

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.engine import Sampler

CPU = torch.device("cpu")


def _draw(
    sampler: Sampler, logits: torch.Tensor, p: SamplingParams, n: int, seed: int | None = None
) -> list[int]:
    gen = sampler.request_generator(seed) if seed is not None else None
    return [int(sampler.sample(logits[None], [p], [gen])[0]) for _ in range(n)]


def test_greedy_and_top_k_1_pick_the_argmax() -> None:
    s = Sampler(CPU, seed=0)
    logits = torch.randn(5, 50)
    greedy = s.sample(logits, [SamplingParams()] * 5, [None] * 5)
    assert torch.equal(greedy, logits.argmax(-1))
    topk1 = s.sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 5, [None] * 5)
    assert torch.equal(topk1, greedy)
    # A tiny top_p keeps only the most likely token too.
    tiny_p = s.sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 5, [None] * 5)
    assert torch.equal(tiny_p, greedy)


def test_top_k_and_top_p_restrict_the_support() -> None:
    s = Sampler(CPU, seed=0)
    logits = torch.tensor([3.0, 2.9, 2.8, -5.0, -5.0, -6.0])
    got_k = set(_draw(s, logits, SamplingParams(temperature=5.0, top_k=2), 300))
    assert got_k == {0, 1}
    # probs at T=1: ~[.37, .34, .30, ...]: top_p=0.6 keeps exactly the first two tokens.
    got_p = set(_draw(s, logits, SamplingParams(temperature=1.0, top_p=0.6), 300))
    assert got_p == {0, 1}


def test_temperature_sampling_follows_the_distribution() -> None:
    s = Sampler(CPU, seed=0)
    probs = torch.tensor([0.5, 0.3, 0.2])
    draws = _draw(s, probs.log(), SamplingParams(temperature=1.0), 3000)
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.04), freq
    # A high temperature flattens it.
    hot = _draw(s, probs.log(), SamplingParams(temperature=100.0), 3000)
    assert torch.bincount(torch.tensor(hot), minlength=3).min() > 800


def test_seeds_reproduce_and_differ() -> None:
    logits = torch.zeros(1000)  # uniform: any two different seeds almost surely disagree
    p = SamplingParams(temperature=1.0, seed=7)
    a = _draw(Sampler(CPU, seed=0), logits, p, 20, seed=7)
    b = _draw(Sampler(CPU, seed=123), logits, p, 20, seed=7)  # the engine seed does not matter
    c = _draw(Sampler(CPU, seed=0), logits, p, 20, seed=8)
    assert a == b
    assert a != c
    # Without a request seed, the engine's seeded generator makes runs reproducible.
    u1 = _draw(Sampler(CPU, seed=5), logits, SamplingParams(temperature=1.0), 20)
    u2 = _draw(Sampler(CPU, seed=5), logits, SamplingParams(temperature=1.0), 20)
    assert u1 == u2


def test_a_seeded_row_does_not_depend_on_its_batch_mates() -> None:
    logits = torch.randn(4, 200)
    params = [
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=20),
        SamplingParams(temperature=0.5, top_p=0.9, seed=4),
    ]
    s = Sampler(CPU, seed=0)
    alone0 = int(s.sample(logits[:1], params[:1], [s.request_generator(3)])[0])
    alone3 = int(s.sample(logits[3:], params[3:], [s.request_generator(4)])[0])
    mixed = s.sample(logits, params, [s.request_generator(3), None, None, s.request_generator(4)])
    assert int(mixed[0]) == alone0 and int(mixed[3]) == alone3
    assert int(mixed[1]) == int(logits[1].argmax())


def _sorted_rows(scale: float, seed: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    """24 rows over a 5,000-token vocabulary (more than the CPU's 1,024 candidates) and top-k/top-p
    parameters of every kind, the logits spread by `scale`."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(24, 5000, generator=g) * scale
    kinds = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.5, seed=11),
        SamplingParams(temperature=0.7, top_k=40),
        SamplingParams(temperature=1.2, top_k=40, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=2000, top_p=0.95),
        SamplingParams(temperature=0.5, top_p=1e-6),
    ]
    return logits, [kinds[i % len(kinds)] for i in range(24)]


def _sample_both(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tokens through the candidates, tokens through the whole sorted vocabulary, how many times
    the candidate sampler fell back to the full sort), the same uniforms for both."""
    fast, full = Sampler(CPU, seed=1), Sampler(CPU, seed=1)
    full.candidates = None
    fallbacks = 0
    inner = fast._sample_sorted_full

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        nonlocal fallbacks
        fallbacks += 1
        return inner(*args, **kwargs)

    fast._sample_sorted_full = counted  # type: ignore[method-assign]
    gens = [
        [s.request_generator(p.seed) if p.seed is not None else None for p in params] for s in (fast, full)
    ]
    return fast.sample(logits, params, gens[0]), full.sample(logits, params, gens[1]), fallbacks


@pytest.mark.parametrize("big_top_k", [True, False], ids=["top_k_2000", "nuclei_in_64"])
def test_top_k_top_p_over_the_candidates_picks_what_the_full_sort_picks(big_top_k: bool) -> None:
    for seed in range(3):
        logits, params = _sorted_rows(scale=4.0, seed=seed)  # peaked: every nucleus among 1,024 tokens
        if not big_top_k:  # no top_k past the first candidate size: 64 candidates, then 1,024
            params = [p if p.top_k != 2000 else SamplingParams(temperature=1.0, top_p=0.3) for p in params]
        fast, full, fallbacks = _sample_both(logits, params)
        assert fallbacks == 0
        assert torch.equal(fast, full), (fast, full)
        assert all(int(t) in set(logits[i].topk(2000).indices.tolist()) for i, t in enumerate(fast))


def test_a_nucleus_past_the_candidates_takes_the_full_sort() -> None:
    logits, params = _sorted_rows(scale=0.1, seed=5)  # flat: top_p 0.9 needs ~4,500 of 5,000 tokens
    fast, full, fallbacks = _sample_both(logits, params)
    assert fallbacks == 1
    assert torch.equal(fast, full)

"""Sampling parameters float32 sampling cannot honour, and logits no model should produce: the
validation refuses what is meaningless (NaN, inf, seeds torch cannot take), tiny temperatures
sample greedily, and the sampler returns an in-range token whatever it is given (issue 9, finding 1)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.core import GREEDY_TEMPERATURE, SamplingParams
from minisgl.engine import Sampler

CPU = torch.device("cpu")
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=NAN), "temperature"),
        (SamplingParams(temperature=INF), "temperature"),
        (SamplingParams(temperature=-INF), "temperature"),
        (SamplingParams(temperature=0.5, top_p=NAN), "top_p"),
        (SamplingParams(temperature=0.5, top_p=INF), "top_p"),
        (SamplingParams(temperature=0.5, seed=2**64), "seed"),
        (SamplingParams(temperature=0.5, seed=-(2**63) - 1), "seed"),
    ],
)
def test_validate_refuses_what_sampling_cannot_honour(params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        params.validate(vocab_size=100)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-40),  # rounds to 0 in float32
        SamplingParams(temperature=GREEDY_TEMPERATURE / 2),
        SamplingParams(temperature=1.0, top_p=1e-46),  # rounds to 0 in float32
        SamplingParams(temperature=1.0, top_p=5e-324),
        SamplingParams(temperature=1.0, top_k=2**63),  # more than an int64 holds... almost
        SamplingParams(temperature=1.0, top_k=2**80),
        SamplingParams(temperature=0.7, seed=2**64 - 1),
        SamplingParams(temperature=0.7, seed=-(2**63)),
    ],
)
def test_extreme_but_valid_params_are_accepted(params: SamplingParams) -> None:
    params.validate(vocab_size=100)


def test_tiny_temperature_and_tiny_top_p_pick_the_argmax() -> None:
    s = Sampler(CPU, seed=0)
    logits = torch.randn(6, 300)
    argmax = logits.argmax(-1)
    for p in (
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1e-6),
        SamplingParams(temperature=1.0, top_p=1e-46),
        SamplingParams(temperature=1.0, top_p=1e-300, seed=3),
    ):
        assert p.is_greedy or p.top_p < 1e-40
        for _ in range(5):
            assert torch.equal(s.sample(logits, [p] * 6, [None] * 6), argmax), p


def test_huge_top_k_is_no_limit() -> None:
    logits = torch.zeros(1, 50)
    p = SamplingParams(temperature=1.0, top_k=2**80, seed=1)
    s = Sampler(CPU, seed=0)
    gen = s.request_generator(1)
    got = {int(s.sample(logits, [p], [gen])[0]) for _ in range(400)}
    assert len(got) > 40  # uniform over all 50 tokens, as with top_k disabled


def test_rows_of_nan_and_inf_logits_give_in_range_tokens() -> None:
    s = Sampler(CPU, seed=0)
    v = 64
    rows = torch.randn(6, v)
    rows[0] = NAN
    rows[1] = -INF
    rows[2] = INF
    rows[3, 5] = INF  # one +inf: softmax is NaN for the whole row
    rows[4, ::2] = NAN
    rows[5] = torch.finfo(torch.float32).max
    for p in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=3, top_p=0.5)):
        got = s.sample(rows, [p] * 6, [None] * 6)
        assert got.shape == (6,) and bool(((got >= 0) & (got < v)).all()), got


_ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True)
_PARAMS = st.builds(
    SamplingParams,
    temperature=st.one_of(_ANY_FLOAT, st.floats(0, 1e-3), st.just(1.0)),
    top_k=st.one_of(st.integers(-(2**70), 2**70), st.integers(-2, 10)),
    top_p=st.one_of(_ANY_FLOAT, st.floats(0, 1)),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
)
_LOGIT = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.floats(-30, 30, width=32),
    st.sampled_from([NAN, INF, -INF, 0.0]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), batch=st.integers(1, 4), vocab=st.integers(1, 40))
def test_any_params_and_any_logits_give_an_in_range_token(
    data: st.DataObject, batch: int, vocab: int
) -> None:
    """Whatever reaches the sampler (validated or not), it returns one token id in [0, vocab) per row."""
    params = data.draw(st.lists(_PARAMS, min_size=batch, max_size=batch))
    values = data.draw(st.lists(_LOGIT, min_size=batch * vocab, max_size=batch * vocab))
    logits = torch.tensor(values, dtype=torch.float32).view(batch, vocab)
    s = Sampler(CPU, seed=0)
    gens = [s.request_generator(p.seed) if p.seed is not None else None for p in params]
    got = s.sample(logits, params, gens)
    assert got.shape == (batch,) and got.dtype == torch.int64
    assert bool(((got >= 0) & (got < vocab)).all()), (got, params)
    for i, p in enumerate(params):  # a finite greedy row still gets its argmax
        if p.is_greedy and bool(torch.isfinite(logits[i]).all()):
            assert int(got[i]) == int(logits[i].argmax())


@settings(max_examples=200, deadline=None)
@given(params=_PARAMS)
def test_validate_never_passes_a_non_finite_float(params: SamplingParams) -> None:
    try:
        params.validate(vocab_size=10)
    except ValueError:
        return
    assert math.isfinite(params.temperature) and math.isfinite(params.top_p)


def test_scheduler_rejects_non_finite_params_with_an_error_reply() -> None:
    """A UserMsg that bypassed the tokenizer's checks (e.g. straight onto the backend socket) is
    refused by the scheduler's own validation; the scheduler keeps serving."""
    from test_scheduler import Harness

    from minisgl.message import ErrorMsg

    s = Harness()
    s.submit(1, [1, 2], temperature=NAN, max_tokens=3)
    s.submit(2, [1, 2], temperature=INF, max_tokens=3)
    s.submit(3, [1, 2], temperature=0.5, seed=2**64, max_tokens=3)
    s.submit(4, [1, 2], temperature=1e-40, top_p=1e-46, top_k=2**80, max_tokens=3)
    s.run_until_idle()
    errors = {m.uid: m.message for m in s.outbox if isinstance(m, ErrorMsg)}
    assert set(errors) == {1, 2, 3}
    assert "temperature" in errors[1] and "temperature" in errors[2] and "seed" in errors[3]
    assert len(s.tokens(4)) == 3

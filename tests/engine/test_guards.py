"""Guards against one-line bugs that the rest of the suite let through (issue 13, mutation testing):
the sampler's distribution after top-k/top-p against the renormalised softmax, a seeded request's
generator kept across engine steps, and the codec refusing a bool wherever an int is declared
(through the public decoders only, so the tests outlive a rewrite of the codec)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import torch
from test_engine import TinyConfig, TinyModel

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine import Engine, EngineOptions, Sampler
from minisgl.message import (
    BaseBackendMsg,
    BaseFrontendMsg,
    BaseTokenizerMsg,
    MessageDecodeError,
)
from minisgl.utils import ZmqPullQueue

CPU = torch.device("cpu")

# ---- the sampler's distribution ------------------------------------------------------------------

LOGITS = torch.tensor([2.0, 1.6, 1.1, 0.9, 0.2, -0.4, -1.0, -3.0])  # distinct: a strict order


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """What the sampler must draw from, in float64: softmax(logits / T) over the top k tokens,
    renormalised, then the smallest prefix (by probability) whose mass reaches top_p, renormalised."""
    probs = (logits.double() / p.temperature).softmax(-1)
    order = probs.argsort(descending=True)
    k = p.top_k if p.top_k > 0 else len(probs)
    kept = torch.zeros_like(probs)
    kept[order[:k]] = probs[order[:k]]
    kept /= kept.sum()
    mass_before = kept[order].cumsum(0) - kept[order]
    drop = order[(mass_before >= p.top_p) & (torch.arange(len(order)) > 0)]
    kept[drop] = 0.0
    return kept / kept.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.5, top_k=4, top_p=0.7),
        SamplingParams(temperature=0.5, top_k=5, top_p=0.95, seed=11),
    ],
    ids=["plain", "top_p", "T+top_p", "top_k", "T+top_k+top_p", "seeded"],
)
def test_sampler_frequencies_match_the_renormalised_softmax(params: SamplingParams) -> None:
    """20,000 draws (one batch, the engine's seeded generator or one request generator): the total
    variation distance to the reference is about 0.01 here, while leaving the draw unscaled by the
    kept mass, or keeping one token too many or too few, moves it by 0.08 or more."""
    n = 20_000
    sampler = Sampler(CPU, seed=0)
    if params.seed is None:
        draws = sampler.sample(LOGITS.expand(n, -1), [params] * n, [None] * n)
    else:
        gen = sampler.request_generator(params.seed)
        draws = torch.cat([sampler.sample(LOGITS[None], [params], [gen]) for _ in range(2_000)])
        n = len(draws)
    freq = torch.bincount(draws, minlength=len(LOGITS)).double() / n
    ref = reference_probs(LOGITS, params)
    assert set(draws.unique().tolist()) == set(ref.nonzero().flatten().tolist())  # the support exactly
    tv = 0.5 * (freq - ref).abs().sum().item()
    assert tv < 0.04, (freq, ref)


def test_top_p_keeps_the_right_number_of_tokens() -> None:
    """The support at each top_p, from the reference: a cut off by one token changes it."""
    sampler = Sampler(CPU, seed=0)
    for top_p in (0.3, 0.5, 0.7, 0.9, 0.99):
        p = SamplingParams(temperature=1.0, top_p=top_p)
        draws = sampler.sample(LOGITS.expand(5_000, -1), [p] * 5_000, [None] * 5_000)
        expected = set(reference_probs(LOGITS, p).nonzero().flatten().tolist())
        assert set(draws.unique().tolist()) == expected, top_p


# ---- a seeded request's generator lives as long as the request -----------------------------------

STEPS = 8


def _seeded_run(seed: int) -> list[int]:
    """One seeded request through the engine (prefill, then decode steps), with a model whose logits
    are all zero: every step is a uniform draw over the vocabulary from the request's generator."""
    cfg = TinyConfig()
    model = TinyModel(cfg).eval()
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
    engine = Engine(model, cfg, EngineOptions(page_size=4, num_pages=16, max_running_requests=2, seed=0))
    params = SamplingParams(temperature=1.0, max_tokens=STEPS, seed=seed)
    req = Req(uid=0, token_ids=[5, 6, 7], sampling_params=params)
    req.table_row = engine.page_table.alloc_row(req.uid)
    assert engine.page_table.reserve(req.table_row, req.prompt_len + STEPS)
    [tok] = engine.forward_batch(Batch([req], [req.prompt_len], "prefill"))
    req.cached_len = req.prompt_len
    req.token_ids.append(tok)
    while req.output_len < STEPS:
        [tok] = engine.forward_batch(Batch([req], [1], "decode"))
        req.cached_len += 1
        req.token_ids.append(tok)
    engine.page_table.free_row(req.table_row)
    return req.output_ids


def _sampler_stream(seed: int, reseed_each_step: bool) -> list[int]:
    sampler = Sampler(CPU, seed=0)
    params = SamplingParams(temperature=1.0, seed=seed)
    zeros = torch.zeros(1, TinyConfig().vocab_size)
    gen = sampler.request_generator(seed)
    out = []
    for _ in range(STEPS):
        if reseed_each_step:
            gen = sampler.request_generator(seed)
        out.append(int(sampler.sample(zeros, [params], [gen])[0]))
    return out


def test_a_seeded_request_draws_one_stream_across_steps() -> None:
    run = _seeded_run(seed=1234)
    assert run == _sampler_stream(1234, reseed_each_step=False)  # one generator, made once
    assert run != _sampler_stream(1234, reseed_each_step=True)  # not the first draw over and over
    assert len(set(run)) > 2
    assert _seeded_run(seed=1234) == run  # a fresh run with the same seed repeats it
    assert _seeded_run(seed=1235) != run


# ---- the codec never takes a bool for an int --------------------------------------------------------

SP = {
    "__type__": "SamplingParams",
    "temperature": 0.5,
    "top_k": 4,
    "top_p": 0.9,
    "ignore_eos": False,
    "max_tokens": 8,
    "stop_token_ids": [2, 3],
    "seed": 7,
}
TENSOR = {"__type__": "Tensor", "buffer": b"\x01\x00\x00\x00", "dtype": "torch.int32"}


def _user(**sp: object) -> dict:
    return {"__type__": "UserMsg", "uid": 1, "input_ids": TENSOR, "sampling_params": {**SP, **sp}}


# (group, a valid message dict with True where an int (or a float) is declared, the field's path)
BOOL_FOR_INT = [
    (BaseBackendMsg, {"__type__": "AbortBackendMsg", "uid": True}, "AbortBackendMsg.uid"),
    (BaseBackendMsg, {**_user(), "uid": False}, "UserMsg.uid"),
    (BaseBackendMsg, _user(top_k=True), "UserMsg.sampling_params.top_k"),
    (BaseBackendMsg, _user(max_tokens=True), "UserMsg.sampling_params.max_tokens"),
    (BaseBackendMsg, _user(seed=True), "UserMsg.sampling_params.seed"),
    (BaseBackendMsg, _user(stop_token_ids=[2, True]), "UserMsg.sampling_params.stop_token_ids[1]"),
    (BaseBackendMsg, _user(temperature=True), "UserMsg.sampling_params.temperature"),
    (
        BaseBackendMsg,
        {
            "__type__": "BatchBackendMsg",
            "data": [{"__type__": "AbortBackendMsg", "uid": 3}, _user(top_k=True)],
        },
        "BatchBackendMsg.data[1].sampling_params.top_k",
    ),
    (
        BaseBackendMsg,
        {"__type__": "BatchBackendMsg", "data": [{"__type__": "AbortBackendMsg", "uid": True}]},
        "BatchBackendMsg.data[0].uid",
    ),
    (
        BaseTokenizerMsg,
        {"__type__": "DetokenizeMsg", "uid": 1, "next_token": True, "finished": False},
        "DetokenizeMsg.next_token",
    ),
    (
        BaseTokenizerMsg,
        {
            "__type__": "BatchTokenizerMsg",
            "data": [
                {
                    "__type__": "DetokenizeMsg",
                    "uid": 1,
                    "next_token": 2,
                    "finished": True,
                    "extra": {"__type__": "DetokenizeExtra", "cached_tokens": True},
                }
            ],
        },
        "BatchTokenizerMsg.data[0].extra.cached_tokens",
    ),
    (
        BaseTokenizerMsg,
        {"__type__": "TokenizeMsg", "uid": 1, "text": "hi", "sampling_params": SP, "n": True},
        "TokenizeMsg.n",
    ),
    (
        BaseTokenizerMsg,
        {"__type__": "TokenizeMsg", "uid": 1, "text": [5, True], "sampling_params": SP},
        "TokenizeMsg.text",  # a union: "expected str | ... | list[int], got list [5, True]"
    ),
    (
        BaseFrontendMsg,
        {
            "__type__": "UserReply",
            "uid": 1,
            "incremental_output": "",
            "finished": False,
            "prompt_tokens": True,
        },
        "UserReply.prompt_tokens",
    ),
]


def _valid(data: object) -> object:
    """The same message with every bool that stands for a number made a number."""
    if isinstance(data, dict):
        return {
            k: (int(v) if k not in ("finished", "ignore_eos") and type(v) is bool else _valid(v))
            for k, v in data.items()
        }
    if isinstance(data, list):
        return [int(v) if type(v) is bool else _valid(v) for v in data]
    return data


@pytest.mark.parametrize(("base", "data", "where"), BOOL_FOR_INT, ids=[w for _, _, w in BOOL_FOR_INT])
def test_a_bool_is_not_an_int(base: type, data: dict, where: str, ipc_dir: Path) -> None:
    base.decoder(_valid(data))  # the message itself is fine once the bool is a number
    error = rf"^{_pattern(where)}: expected .*got (bool|list \[5, True\])"
    with pytest.raises(MessageDecodeError, match=error):
        base.decoder(data)
    raw = msgpack.packb(data, use_bin_type=True)
    with pytest.raises(MessageDecodeError, match=error):
        base.from_bytes(raw)
    queue = ZmqPullQueue(f"ipc://{ipc_dir}/q", create=True, decoder=base.decoder)
    try:
        queue.decode(msgpack.packb(_valid(data), use_bin_type=True))
        with pytest.raises(MessageDecodeError, match=error):
            queue.decode(raw)
    finally:
        queue.stop()


def _pattern(where: str) -> str:
    return where.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")

"""The sampling features on CUDA (skipped without a GPU): penalties, biases and logprobs give the same
results with CUDA graphs as without, the batched device ops equal their CPU results, and structured
output keeps to its schema on the GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_cuda_graph_gpu import SHAPE, _engine, _prompts, model_dir  # noqa: F401 (a fixture)
from test_engine import _run
from test_models_support import save_byte_tokenizer, save_tiny_hf_model

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine import Engine
from minisgl.engine.logprobs import LogprobTensors
from minisgl.engine.penalties import apply_penalties
from minisgl.grammar import apply_bitmask, json_schema_grammar

pytestmark = pytest.mark.gpu

N = 20


def _mixed(n: int) -> list[SamplingParams]:
    """Greedy rows, each with one feature that takes it off the CUDA graph's argmax."""
    return [
        SamplingParams(max_tokens=n),
        SamplingParams(max_tokens=n, repetition_penalty=1.6),
        SamplingParams(max_tokens=n, frequency_penalty=0.9, presence_penalty=0.4),
        SamplingParams(max_tokens=n, logit_bias={17: 4.0, 23: -100.0}),
        SamplingParams(max_tokens=n, min_tokens=n, stop_token_ids=[5]),
        SamplingParams(max_tokens=n, logprobs=3),
    ]


def test_penalties_and_biases_give_the_same_tokens_with_graphs(model_dir: Path) -> None:  # noqa: F811
    eager, graphed = _engine(model_dir, torch.float32, 0), _engine(model_dir, torch.float32, 16)
    prompts = _prompts(6, seed=7)
    want = _run(eager, prompts, N, chunk=64, params=_mixed(N))
    assert _run(graphed, prompts, N, chunk=64, params=_mixed(N)) == want
    plain = _run(eager, prompts, N, chunk=64)
    assert want[0] == plain[0]  # the plain row is untouched by its neighbours' features
    assert want[1] != plain[1] or want[2] != plain[2]  # penalties change (repetitive) greedy text
    assert 23 not in want[3] and 5 not in want[4]


def _decode_logprobs(engine: Engine, prompts: list[list[int]], n: int) -> list[dict[int, object]]:
    """Prefill, then `n` decode steps of every prompt with logprobs=3; each step's logprobs by uid."""
    table = engine.page_table
    reqs = [
        Req(uid=i, token_ids=list(p), sampling_params=SamplingParams(max_tokens=n, logprobs=3))
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        r.prompt_len = len(r.token_ids)
        r.table_row = table.alloc_row(r.uid)
        assert table.reserve(r.table_row, r.prompt_len + n)
    out = engine.launch(Batch(reqs, [r.prompt_len for r in reqs], "prefill"))
    steps = []
    for _ in range(n):
        for r, t in zip(reqs, out.tolist(), strict=True):
            r.cached_len = len(r.token_ids)
            r.token_ids.append(t)
        steps.append(out.logprobs()[0])
        out = engine.launch(Batch(reqs, [1] * len(reqs), "decode"))
    out.tolist()
    for r in reqs:
        table.free_row(r.table_row)
    return steps


def test_logprobs_with_graphs_equal_the_eager_ones(model_dir: Path) -> None:  # noqa: F811
    prompts = _prompts(3, seed=11)
    eager = _decode_logprobs(_engine(model_dir, torch.float32, 0), prompts, 6)
    graphed = _decode_logprobs(_engine(model_dir, torch.float32, 16), prompts, 6)
    assert len(eager) == len(graphed) == 6
    for a, b in zip(eager, graphed, strict=True):
        assert a.keys() == b.keys() == {0, 1, 2}
        for uid in a:
            assert _close(a[uid], b[uid]), (uid, a[uid], b[uid])


def _close(a: object, b: object) -> bool:
    """Two logprob records (nested tuples/lists/dataclasses of ids and floats) equal within 1e-4."""
    fa, fb = _flat(a), _flat(b)
    return len(fa) == len(fb) and all(
        (x == y) if isinstance(x, int) else abs(x - y) < 1e-4 for x, y in zip(fa, fb, strict=True)
    )


def _flat(x: object) -> list[float | int]:
    if isinstance(x, (int, float)):
        return [x]
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in _flat(item)]
    if hasattr(x, "__dataclass_fields__"):
        return [v for name in x.__dataclass_fields__ for v in _flat(getattr(x, name))]
    raise TypeError(type(x))


def test_device_ops_equal_their_cpu_results() -> None:
    torch.manual_seed(0)
    v, eos = 50, [49]
    reqs = []
    for i, kw in enumerate(
        [
            dict(frequency_penalty=0.7),
            dict(presence_penalty=-1.5),
            dict(repetition_penalty=1.8),
            dict(logit_bias={0: 100.0, 7: -3.5}),
            dict(min_tokens=3, stop_token_ids=[2]),
        ]
    ):
        r = Req(uid=i, token_ids=[1, 2, 3, 4, 4, 5], sampling_params=SamplingParams(**kw), prompt_len=3)
        reqs.append(r)
    logits = torch.randn(len(reqs), v) * 3
    cpu = apply_penalties(logits.clone(), reqs, eos)
    gpu = apply_penalties(logits.cuda(), reqs, eos)
    torch.testing.assert_close(gpu.cpu(), cpu)
    chosen = torch.tensor([0, 5, 11, 3, 9])
    a, b = LogprobTensors.of(logits, chosen, 4), LogprobTensors.of(logits.cuda(), chosen.cuda(), 4)
    torch.testing.assert_close(b.logprobs.cpu(), a.logprobs)
    mask = torch.randint(-(2**31), 2**31 - 1, (2, (v + 31) // 32), dtype=torch.int32)
    on_cpu, on_gpu = logits[:2].clone(), logits[:2].cuda()
    apply_bitmask(on_cpu, mask)
    apply_bitmask(on_gpu, mask.cuda())  # the engine moves each step's masks to the logits' device
    assert torch.equal(on_gpu.cpu(), on_cpu)


SCHEMA = {
    "type": "object",
    "properties": {"c": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["c", "n"],
    "additionalProperties": False,
}


def test_structured_output_on_the_gpu(tmp_path: Path) -> None:
    """A tiny random model with a byte-level tokenizer on CUDA (bf16, graphs on): a schema row beside
    a free greedy row and a penalised sampled row gives valid JSON and stops when complete."""
    from minisgl import LLM

    shape = {**SHAPE, "eos_token_id": 256, "bos_token_id": 257}
    model = save_tiny_hf_model("LlamaForCausalLM", tmp_path, False, vocab=2000, **shape)
    save_byte_tokenizer(model, 2000)
    llm = LLM(str(model), device="cuda", max_seq_len=256)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=12, repetition_penalty=1.2, ignore_eos=True)
    held = SamplingParams(temperature=0, max_tokens=80, grammar=json_schema_grammar(SCHEMA))
    out = llm.generate(["hello", "json:", "abc"], [free, held, sampled])
    assert out[1]["finish_reason"] == "stop", (out[1]["text"], out[1]["token_ids"])
    assert set(json.loads(out[1]["text"])) == {"c", "n"}
    assert len(out[0]["token_ids"]) == 12 and len(out[2]["token_ids"]) == 12

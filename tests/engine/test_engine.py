"""The engine over a tiny fake model: paged, chunked, batched forward == dense recompute."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from minisgl.core import Batch, Req, SamplingParams, get_global_ctx
from minisgl.engine import DummyEngine, Engine, EngineOptions


@dataclass
class TinyConfig:
    vocab_size: int = 97
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    max_position_embeddings: int = 128
    eos_token_ids: list[int] = field(default_factory=lambda: [0])


class TinyModel(nn.Module):
    """A rope-less GQA transformer; `dense=True` runs plain causal attention over the whole input."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.cfg = cfg
        self.num_local_heads, self.num_local_kv_heads = cfg.num_heads, cfg.num_kv_heads
        h, d = cfg.hidden_size, cfg.head_dim
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.pos = nn.Embedding(cfg.max_position_embeddings, h)
        self.qkv = nn.ModuleList(
            [nn.Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d) for _ in range(cfg.num_layers)]
        )
        self.o = nn.ModuleList([nn.Linear(cfg.num_heads * d, h) for _ in range(cfg.num_layers)])
        self.head = nn.Linear(h, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, dense: bool = False) -> torch.Tensor:
        c = self.cfg
        x = self.embed(input_ids) + self.pos(positions)  # (T, H)
        for i in range(c.num_layers):
            q, k, v = self.qkv[i](x).split(
                [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], -1
            )
            q = q.view(-1, c.num_heads, c.head_dim)
            k = k.view(-1, c.num_kv_heads, c.head_dim)
            v = v.view(-1, c.num_kv_heads, c.head_dim)
            if dense:
                g = c.num_heads // c.num_kv_heads
                a = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(0, 1),
                    k.repeat_interleave(g, 1).transpose(0, 1),
                    v.repeat_interleave(g, 1).transpose(0, 1),
                    is_causal=True,
                ).transpose(0, 1)
            else:
                a = get_global_ctx().attn_backend.forward(q, k, v, i)
            x = x + self.o[i](a.reshape(-1, c.num_heads * c.head_dim))
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()


def _reference(model: TinyModel, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            t = torch.tensor(ids)
            h = model(t, torch.arange(len(ids)), dense=True)
            ids.append(int(model.compute_logits(h[-1:]).argmax(-1)))
    return ids[len(prompt) :]


def _run(
    engine: Engine | DummyEngine,
    prompts: list[list[int]],
    n: int,
    chunk: int,
    params: list[SamplingParams] | None = None,
) -> list[list[int]]:
    """A minimal scheduler: chunked prefill of every prompt together, then batched decode (greedy
    unless `params` gives each prompt its own)."""
    table = engine.page_table
    params = params or [SamplingParams(max_tokens=n) for _ in prompts]
    reqs = [
        Req(uid=i, token_ids=list(p), sampling_params=sp)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    for r in reqs:
        r.table_row = table.alloc_row(r.uid)
        assert table.reserve(r.table_row, r.prompt_len + n)
    while any(r.remaining_len > 0 and r.output_len == 0 for r in reqs):
        todo = [r for r in reqs if r.output_len == 0]
        ext = [min(chunk, r.remaining_len) for r in todo]
        toks = engine.forward_batch(Batch(todo, ext, "prefill"))
        done = [r for r, e in zip(todo, ext, strict=True) if r.cached_len + e == r.seq_len]
        for r, e in zip(todo, ext, strict=True):
            r.cached_len += e
        for r, t in zip(done, toks, strict=True):
            r.token_ids.append(t)
    while any(r.output_len < n for r in reqs):
        toks = engine.forward_batch(Batch(reqs, [1] * len(reqs), "decode"))
        for r, t in zip(reqs, toks, strict=True):
            r.cached_len += 1
            r.token_ids.append(t)
    for r in reqs:
        table.free_row(r.table_row)
    table.check_integrity(set())
    return [r.output_ids[:n] for r in reqs]


def _engine(**kw: object) -> tuple[Engine, TinyModel]:
    cfg = TinyConfig()
    model = TinyModel(cfg).eval()
    opts = EngineOptions(page_size=4, num_pages=64, max_running_requests=8, **kw)  # type: ignore[arg-type]
    return Engine(model, cfg, opts), model


def test_engine_chunked_batched_greedy_equals_dense_recompute() -> None:
    engine, model = _engine()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
    expected = [_reference(model, p, 6) for p in prompts]
    assert _run(engine, prompts, 6, chunk=5) == expected
    assert _run(engine, prompts, 6, chunk=100) == expected
    assert [_run(engine, [p], 6, chunk=3)[0] for p in prompts] == expected


def test_engine_sizes_pool_from_memory_and_caps_context() -> None:
    cfg = TinyConfig()
    per_page = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 4  # float32, page_size 4
    engine = Engine(TinyModel(cfg), cfg, EngineOptions(page_size=4, kv_cache_memory=per_page * 10 + 7))
    assert engine.num_pages == 10
    assert engine.max_seq_len == 40  # the pool holds 40 tokens < the model's 128


def test_dummy_engine_is_deterministic_and_avoids_eos() -> None:
    opts = EngineOptions(page_size=4, num_pages=64, max_running_requests=4)
    a = DummyEngine(opts, vocab_size=3, eos_token_ids=[0, 1])
    b = DummyEngine(opts, vocab_size=3, eos_token_ids=[0, 1])
    out_a = _run(a, [[2, 2, 2], [2]], 5, chunk=2)
    assert out_a == _run(b, [[2, 2, 2], [2]], 5, chunk=2)
    assert all(t == 2 for seq in out_a for t in seq)  # the only non-EOS id of a 3-token vocabulary


def test_dummy_engine_step_time_comes_from_the_config() -> None:
    """--dummy-step-ms reaches the engine through create_engine and every step takes at least that
    long (tests use it so that a long request cannot finish during the test on a fast machine)."""
    import dataclasses
    import time

    from minisgl.distributed import DistributedInfo
    from minisgl.engine import create_engine
    from minisgl.scheduler.config import SchedulerConfig

    cfg = SchedulerConfig(
        model_path="none",
        tp_info=DistributedInfo(0, 1),
        dtype=torch.float32,
        engine="dummy",
        num_pages=64,
        page_size=4,
        max_running_requests=4,
        dummy_step_ms=20.0,
    )
    engine = create_engine(cfg)
    assert isinstance(engine, DummyEngine) and engine.step_s == 0.02
    t0 = time.perf_counter()
    out = _run(engine, [[2, 2, 2]], 3, chunk=8)  # one prefill step and two decode steps
    assert time.perf_counter() - t0 >= 3 * 0.02 and len(out[0]) == 3
    assert create_engine(dataclasses.replace(cfg, dummy_step_ms=0.0)).step_s == 0.0
    with pytest.raises(ValueError, match="dummy_step_ms"):
        dataclasses.replace(cfg, dummy_step_ms=-1.0)
    with pytest.raises(ValueError, match="step_ms"):
        DummyEngine(EngineOptions(num_pages=8), step_ms=-1.0)


def test_argmax_rows_is_argmax_with_first_index_on_ties() -> None:
    from minisgl.engine.cuda_graph import argmax_rows

    gen = torch.Generator().manual_seed(0)
    for vocab in (97, 1000, 49152, 128256):
        logits = torch.randn(5, vocab, generator=gen)
        logits[1, 3] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the first index wins
        logits[2] = 0.0  # all equal: index 0
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))

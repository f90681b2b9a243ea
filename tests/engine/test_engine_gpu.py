"""The engine, attention backend and sampler on CUDA (skipped without a GPU)."""

from __future__ import annotations

import os

import pytest
import torch
from test_engine import TinyConfig, TinyModel, _reference, _run

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineOptions, Sampler

pytestmark = pytest.mark.gpu


def test_cuda_engine_float32_matches_dense_cpu_reference() -> None:
    cfg = TinyConfig()
    cpu_model = TinyModel(cfg).eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
    expected = [_reference(cpu_model, p, 6) for p in prompts]
    model = TinyModel(cfg).eval().to("cuda")
    engine = Engine(
        model, cfg, EngineOptions(device="cuda", page_size=4, num_pages=64, max_running_requests=8)
    )
    assert engine.pool.k[0].device.type == "cuda"
    if "OMP_NUM_THREADS" not in os.environ:  # the host only prepares metadata: one CPU thread
        assert torch.get_num_threads() == 1
    assert _run(engine, prompts, 6, chunk=5) == expected  # chunked prefill, decode copy, batched
    assert _run(engine, prompts, 6, chunk=100) == expected


def test_cuda_engine_sizes_pool_from_free_memory() -> None:
    cfg = TinyConfig(max_position_embeddings=4096)
    engine = Engine(TinyModel(cfg).to("cuda"), cfg, EngineOptions(device="cuda", gpu_memory_fraction=0.01))
    free, _ = torch.cuda.mem_get_info()
    assert engine.num_pages > 100 and engine.max_seq_len == 4096
    assert free > 0


def test_cuda_sampler_seeds_and_greedy() -> None:
    dev = torch.device("cuda")
    s = Sampler(dev, seed=0)
    logits = torch.randn(4, 1000, device=dev)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    a = s.sample(logits, params, [None, s.request_generator(3), None, None])
    b = s.sample(logits, params, [None, s.request_generator(3), None, None])
    assert a.device.type == "cuda"
    assert int(a[0]) == int(logits[0].argmax()) and int(a[3]) == int(logits[3].argmax())
    assert int(a[1]) == int(b[1])  # same request seed, same draw
    assert int(a[2]) in logits[2].topk(5).indices.tolist()

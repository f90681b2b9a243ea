"""The CUDA path end to end (skipped without a GPU): CUDA graphs change no token, and the logits of
prefill and the first decode steps stay within bf16 tolerance of transformers on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine import _run
from test_models import LLAMA3_ROPE
from test_models_support import save_tiny_hf_model

from minisgl.engine import Engine, EngineOptions
from minisgl.models import load_model

pytestmark = pytest.mark.gpu

SHAPE = dict(  # a small Llama-3-like model: GQA 4:1, head_dim 64, llama3 rope
    hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=2048, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_model(
        "LlamaForCausalLM", tmp_path_factory.mktemp("llama"), False, vocab=2000, **SHAPE
    )


def _engine(model_dir: Path, dtype: torch.dtype, graphs: int) -> Engine:
    model, cfg = load_model(model_dir, dtype, "cuda", progress=False)
    opts = EngineOptions(device="cuda", dtype=dtype, page_size=16, num_pages=256, max_running_requests=16,
                         cuda_graph_max_bs=graphs)  # fmt: skip
    return Engine(model, cfg, opts)


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 2000, (int(torch.randint(3, 90, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_change_no_token(model_dir: Path, dtype: torch.dtype) -> None:
    eager, graphed = _engine(model_dir, dtype, 0), _engine(model_dir, dtype, 16)
    assert eager.graphs is None and graphed.graphs is not None
    for n in (1, 3, 5, 16):  # batches padded to the captured sizes 1, 4, 8, 16
        prompts = _prompts(n, seed=n)
        assert _run(graphed, prompts, 24, chunk=64) == _run(eager, prompts, 24, chunk=64)


def test_logits_within_bf16_tolerance_of_transformers(model_dir: Path) -> None:
    """Prefill and 4 decode steps, batched (graphs on): ours in bf16 against transformers in float32,
    no further off than transformers itself in bf16 (x2)."""
    from transformers import AutoModelForCausalLM

    engine = _engine(model_dir, torch.bfloat16, 16)
    captured: list[torch.Tensor] = []
    sample, replay = engine.sampler.sample, engine.graphs.replay

    def spy_sample(logits: torch.Tensor, params, generators):  # noqa: ANN001, ANN202
        captured.append(logits.float().cpu())
        return sample(logits, params, generators)

    def spy_replay(inputs: torch.Tensor, pending=None):  # noqa: ANN001, ANN202  (greedy steps skip the sampler)
        logits, best = replay(inputs, pending)
        captured.append(logits.float().cpu())
        assert torch.equal(best, logits.argmax(dim=-1))
        return logits, best

    engine.sampler.sample = spy_sample  # type: ignore[method-assign]
    engine.graphs.replay = spy_replay  # type: ignore[method-assign]
    prompts = _prompts(3, seed=7)
    outs = _run(engine, prompts, 5, chunk=1000)  # one prefill step, then 4 decode steps
    assert len(captured) == 5
    ref32 = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
    ref16 = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()
    for b, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        seq = torch.tensor([p + out[:4]], device="cuda")
        with torch.no_grad():
            want = ref32(seq).logits[0, len(p) - 1 :].float().cpu()  # (5, V): the rows that sampled
            hf16 = ref16(seq).logits[0, len(p) - 1 :].float().cpu()
        ours = torch.stack([step[b] for step in captured])  # (5, V)
        err = float((ours - want).norm() / want.norm())
        hf_err = float((hf16 - want).norm() / want.norm())
        assert err <= 2 * hf_err + 1e-3, (b, err, hf_err)


def test_overlap_gives_the_same_greedy_tokens_on_the_gpu(model_dir: Path) -> None:
    """The overlapped loop (the GPU default) against the plain one, with CUDA graphs, bf16: mixed
    lengths, stop tokens and max_tokens, batches that grow and shrink."""
    from minisgl import LLM, SamplingParams

    prompts = _prompts(24, seed=11)
    gen = torch.Generator().manual_seed(3)
    params = [
        SamplingParams(max_tokens=int(torch.randint(1, 40, (1,), generator=gen)), ignore_eos=True)
        for _ in prompts
    ]
    outs = {}
    for overlap in (False, True):
        llm = LLM(
            str(model_dir), device="cuda", overlap_schedule=overlap, num_pages=512, cuda_graph_max_bs=16
        )
        assert llm.overlap is overlap
        outs[overlap] = [(o["token_ids"], o["finish_reason"]) for o in llm.generate(prompts, params)]
        llm.check_integrity()
        del llm
    assert outs[True] == outs[False]

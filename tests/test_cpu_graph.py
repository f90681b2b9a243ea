"""CPU decode graphs (`engine.cpu_graph`): a recorded decode step replays to the same tokens as the
eager steps, for every batch size met; a forward pass with an op outside the kernels turns them off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.kernels import available
from minisgl.kernels.quant import quant_available
from test_gguf import write_tiny_gguf
from test_models_support import save_tiny_hf_model

pytestmark = pytest.mark.skipif(not (available() and quant_available()), reason="needs the CPU kernels")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [100, 3], [40] * 17, [7, 8], [200, 201, 202]]


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("q8")
    hf_dir = save_tiny_hf_model("LlamaForCausalLM", tmp / "hf", tie=True, vocab=259)
    write_tiny_gguf(hf_dir, tmp / "q8.gguf", quant="Q8_0")
    return str(tmp / "q8.gguf")


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(prompts, params)]


def test_replayed_steps_give_the_eager_tokens(
    q8_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    eager = LLM(q8_model, device="cpu", cuda_graph_max_bs=0)
    graphs = LLM(q8_model, device="cpu")
    assert eager.engine.graphs is None and graphs.engine.graphs is not None
    for batch in (PROMPTS[:1], PROMPTS[:3], PROMPTS):  # sizes 1, 3, 5, and smaller ones as requests end
        assert _tokens(graphs, batch) == _tokens(eager, batch)
    runner = graphs.engine.graphs
    assert runner.enabled and {1, 3, 5} <= set(runner.programs)
    sampled = SamplingParams(temperature=0.9, top_k=20, max_tokens=8, seed=3)
    assert _tokens(graphs, PROMPTS, sampled) == _tokens(eager, PROMPTS, sampled)


def test_an_unrecorded_op_turns_the_graphs_off(
    q8_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch op between kernels runs at recording but not at replay: the check catches it, the
    steps run eagerly, and the tokens stay right."""
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    want = _tokens(LLM(q8_model, device="cpu", cuda_graph_max_bs=0), PROMPTS[:2])
    llm = LLM(q8_model, device="cpu")
    norm = llm.engine.model.model.norm
    forward = norm.forward
    monkeypatch.setattr(norm, "forward", lambda x: forward(x) * torch.ones(()))  # a torch op, not a kernel
    assert _tokens(llm, PROMPTS[:2]) == want
    assert not llm.engine.graphs.enabled and llm.engine.graphs.padded_size(1) is None

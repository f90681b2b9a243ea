"""One model, every backend: the engine's greedy tokens through the torch reference, the CPU backend
and the CUDA backend (Triton kernels; on a CPU-only machine they run in Triton's interpreter) agree
in float32, with chunked prefill, batched decode and GQA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine import _run
from test_models import CASES
from test_models_support import save_tiny_hf_model

from minisgl.attention import resolve_attention_backend
from minisgl.backends import create_ops
from minisgl.engine import Engine, EngineOptions
from minisgl.kernels.triton import triton_available
from minisgl.models import load_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = [("torch", "torch"), ("cuda", "triton")] + ([("cpu", "cpu")] if DEV == "cpu" else [])
PROMPTS = [[3, 17, 99, 5, 8], list(range(10, 47)), [120, 7, 7, 7, 64, 33, 2, 90, 11]]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    names = ["llama-llama3-rope-untied", "qwen3-qknorm-tied", "qwen2-bias-untied"]
    return {
        n: save_tiny_hf_model(CASES[n][0], tmp_path_factory.mktemp(n), CASES[n][1], **CASES[n][2])
        for n in names
    }


def _engine(model_dir: Path, ops: str, attention: str, graphs: int = 0) -> Engine:
    model, cfg = load_model(model_dir, torch.float32, DEV, progress=False)
    opts = EngineOptions(
        device=DEV, page_size=4, num_pages=64, max_running_requests=8, ops_backend=ops,
        attention_backend=attention, cuda_graph_max_bs=graphs,
    )  # fmt: skip
    return Engine(model, cfg, opts)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize(
    "case",
    [
        "llama-llama3-rope-untied",
        "qwen3-qknorm-tied",
        # ~10 s through Triton's interpreter on a 2-core CPU: `make test-slow` there
        pytest.param("qwen2-bias-untied", marks=[pytest.mark.slow] if DEV == "cpu" else []),
    ],
)
def test_backends_give_the_same_greedy_tokens(hf_dirs: dict[str, Path], case: str) -> None:
    results = {}
    for ops, attention in BACKENDS:
        engine = _engine(hf_dirs[case], ops, attention)
        assert (engine.ops.name, engine.attn_backend.name) == (ops, attention)
        # chunks over cached prefixes, then two batched decode steps (each decode step of the Triton
        # backend takes seconds in the interpreter without a GPU)
        results[ops] = _run(engine, PROMPTS, 3, chunk=6)
    assert all(r == results["torch"] for r in results.values()), results


def test_auto_picks_the_device_backends(hf_dirs: dict[str, Path]) -> None:
    engine = _engine(hf_dirs["llama-llama3-rope-untied"], "auto", "auto")
    want = ("cuda", "triton") if DEV == "cuda" else ("cpu", "cpu")
    assert (engine.ops.name, engine.attn_backend.name) == want
    # every layer computes through the engine's ops backend
    users = [m for m in engine.model.modules() if hasattr(m, "ops")]
    assert users and all(m.ops is engine.ops for m in users)


def test_unknown_backends_are_refused(hf_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, cpu, triton"):
        _engine(hf_dirs["llama-llama3-rope-untied"], "auto", "flash")
    with pytest.raises(ValueError, match="ops_backend must be one of auto, torch, cpu, cuda"):
        _engine(hf_dirs["llama-llama3-rope-untied"], "gpu", "auto")
    with pytest.raises(ValueError, match="unknown attention backend"):  # past the options' check
        resolve_attention_backend("flash", torch.device(DEV))
    with pytest.raises(ValueError, match="unknown ops backend"):
        create_ops("gpu", DEV)

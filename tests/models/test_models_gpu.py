"""The same model code on CUDA: float32 matches the CPU, bf16/fp16 stay close, dummy weights run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_models import CASES, PROMPTS
from test_models_support import run_prompts, save_tiny_hf_model

from minisgl.models import load_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: save_tiny_hf_model(arch, tmp_path_factory.mktemp(name), tie, **extra)
        for name, (arch, tie, extra) in CASES.items()
    }


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_matches_cpu(hf_dirs: dict[str, Path], case: str) -> None:
    cpu, _ = load_model(hf_dirs[case], torch.float32, "cpu", progress=False)
    want = run_prompts(cpu, PROMPTS)
    gpu, _ = load_model(hf_dirs[case], torch.float32, "cuda", progress=False)
    for got, w in zip(run_prompts(gpu, PROMPTS), want, strict=True):
        assert got.device.type == "cuda" and got.dtype == torch.float32
        torch.testing.assert_close(got.cpu(), w, atol=1e-4, rtol=1e-4)
    for dtype in (torch.bfloat16, torch.float16):
        half, _ = load_model(hf_dirs[case], dtype, "cuda", progress=False)
        for got, w in zip(run_prompts(half, PROMPTS), want, strict=True):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.cpu(), w, atol=0.05, rtol=0.05)


def test_cuda_dummy_weights(hf_dirs: dict[str, Path]) -> None:
    model, cfg = load_model(hf_dirs["qwen3-qknorm-tied"], torch.bfloat16, "cuda", dummy=True, progress=False)
    (logits,) = run_prompts(model, [[1, 2, 3]])
    assert logits.shape == (3, cfg.vocab_size) and torch.isfinite(logits).all()

"""`minisgl bench offline` on random weights of a tiny config: transformers gets the very weights
minisgl draws, at any tensor-parallel size, so greedy outputs agree (the check behind GPU TP runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minisgl.benchmark.offline import print_report, run_offline_bench

TINY = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
    intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, torch_dtype="float32",
)  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2])
def test_random_weights_agree_with_transformers(
    tmp_path: Path, tp: int, capsys: pytest.CaptureFixture
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    extra = {"tp": tp, "cache_type": "naive"} if tp > 1 else {}
    res = run_offline_bench(
        num_prompts=3, output_len=5, min_input_len=8, max_input_len=16, repeats=1, device="cpu",
        model_config=str(config), **extra,
    )  # fmt: skip
    [run] = res["runs"]
    assert run["same_outputs"] == 3, run
    assert ("phases" in run) == (tp == 1)  # per-phase counters live in the engine, in-process only
    print_report(res)
    out = capsys.readouterr().out
    assert "identical outputs: 3/3" in out
    assert ("tensor-parallel over 2 ranks" in out) == (tp == 2)

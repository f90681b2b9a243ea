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


TINY_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, torch_dtype="float32",
)  # fmt: skip


@pytest.mark.parametrize("extra", [{}, {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}])
def test_moe_random_weights_agree_with_transformers(tmp_path: Path, extra: dict, capsys) -> None:
    """transformers keeps a layer's experts fused (and Mixtral's under other names): it still gets
    the weights minisgl draws per checkpoint tensor."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_MOE | extra))
    res = run_offline_bench(
        num_prompts=3, output_len=5, min_input_len=8, max_input_len=16, repeats=1, device="cpu",
        model_config=str(config),
    )  # fmt: skip
    [run] = res["runs"]
    assert run["same_outputs"] == 3, run
    print_report(res)
    assert "identical outputs: 3/3" in capsys.readouterr().out


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_moe_presets_floor_counts_the_experts_a_step_reads(preset: str) -> None:
    """Batch 1 reads the top-k experts of each layer; a large batch nearly all of them."""
    import torch

    from minisgl.benchmark.presets import preset_config
    from minisgl.benchmark.weights_read import WeightCounts, expected_experts
    from minisgl.distributed import DistributedInfo
    from minisgl.models import LlamaForCausalLM, ModelConfig

    cfg = ModelConfig.from_hf_dict(preset_config(preset))
    model = LlamaForCausalLM(cfg, DistributedInfo(0, 1), torch.bfloat16, "meta")
    w = WeightCounts.of(model)
    moe, h = cfg.moe, cfg.hidden_size
    assert moe is not None and (w.num_experts, w.top_k) == (moe.num_experts, moe.top_k)
    assert w.expert == cfg.num_layers * 3 * h * moe.intermediate_size
    total = sum(p.numel() for p in model.parameters()) - cfg.vocab_size * h  # all but the embedding
    assert w.read_bytes(1e9) == pytest.approx(2 * total)  # every expert
    assert w.read_bytes(1) == 2 * (total - (moe.num_experts - moe.top_k) * w.expert)
    assert w.experts_read(1) == pytest.approx(moe.top_k)
    assert expected_experts(128, 8, 64) == pytest.approx(128 * (1 - (120 / 128) ** 64))
    assert w.active() == w.layer + moe.top_k * w.expert
    if preset == "qwen3-30b-a3b":  # ~3.3B active parameters per token, ~30.5B in all
        assert 3.0e9 < w.active() + w.head < 3.6e9 and 30e9 < total + cfg.vocab_size * h < 31e9

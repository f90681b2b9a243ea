"""Our model implementations against Hugging Face transformers on tiny random checkpoints (float32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_models_support import run_prompts, save_tiny_hf_model

from minisgl.models import ModelConfig, load_model
from minisgl.models.config import ModelConfigError

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

CASES = {
    "llama-llama3-rope-untied": (
        "LlamaForCausalLM",
        False,
        {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
    ),
    "llama-tied": ("LlamaForCausalLM", True, {}),
    "llama-attention-bias": ("LlamaForCausalLM", False, {"attention_bias": True}),
    "mistral-untied": ("MistralForCausalLM", False, {"sliding_window": None, "head_dim": 16}),
    "qwen2-bias-tied": ("Qwen2ForCausalLM", True, {}),
    "qwen2-bias-untied": ("Qwen2ForCausalLM", False, {}),
    "qwen3-qknorm-untied": ("Qwen3ForCausalLM", False, {"head_dim": 32}),
    "qwen3-qknorm-tied": ("Qwen3ForCausalLM", True, {"head_dim": 32, "num_key_value_heads": 1}),
}

PROMPTS = [[3, 17, 99, 5, 8], list(range(10, 47)), [120, 7, 7, 7, 64, 33, 2, 90, 11]]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: save_tiny_hf_model(arch, tmp_path_factory.mktemp(name), tie, **extra)
        for name, (arch, tie, extra) in CASES.items()
    }


def hf_logits(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0].float() for p in prompts]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(hf_dirs: dict[str, Path], case: str) -> None:
    model, cfg = load_model(hf_dirs[case], torch.float32, "cpu", progress=False)
    assert cfg.architecture == CASES[case][0]
    ours = run_prompts(model, PROMPTS)
    ref = hf_logits(hf_dirs[case], PROMPTS)
    for got, want in zip(ours, ref, strict=True):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_config_fields(hf_dirs: dict[str, Path]) -> None:
    llama = ModelConfig.from_dir(hf_dirs["llama-llama3-rope-untied"])
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.rope_theta == 500000.0 and not llama.tie_word_embeddings and not llama.attention_bias
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim, llama.num_layers) == (4, 2, 16, 2)
    assert llama.eos_token_ids == [2] and llama.bos_token_id == 1
    qwen2 = ModelConfig.from_dir(hf_dirs["qwen2-bias-tied"])
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.tie_word_embeddings and not qwen2.qk_norm
    qwen3 = ModelConfig.from_dir(hf_dirs["qwen3-qknorm-untied"])
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.family == "qwen3"
    assert ModelConfig.from_dir(hf_dirs["mistral-untied"]).family == "llama"


def test_legacy_config_dialect_and_eos_union(tmp_path: Path) -> None:
    """transformers < 5 writes rope_theta/rope_scaling; EOS ids come from all three sources."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 1234.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [5, 6],
        "bos_token_id": 0,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    tokenizer = {
        "added_tokens": [
            {"id": 8, "content": "<|im_end|>", "special": True},
            {"id": 9, "content": "<|eot_id|>", "special": False},  # not special: not an EOS
        ],
        "model": {"vocab": {"</s>": 3}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4
    assert cfg.eos_token_ids == [3, 5, 6, 7, 8]


@pytest.mark.parametrize("text", ['{"added_tokens": [', "[1, 2]", "not json"])
def test_a_broken_tokenizer_json_is_a_clear_error(tmp_path: Path, text: str) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8}
    config |= {"intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.raises(ModelConfigError, match=r"tokenizer\.json: cannot read JSON"):
        ModelConfig.from_dir(tmp_path)


def test_unsupported_rope_scaling_is_a_clear_error(tmp_path: Path) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*yarn"):
        ModelConfig.from_dir(tmp_path)


def test_bf16_forward_runs_and_stays_close(hf_dirs: dict[str, Path]) -> None:
    path = hf_dirs["qwen3-qknorm-untied"]
    model32, _ = load_model(path, torch.float32, "cpu", progress=False)
    model16, _ = load_model(path, torch.bfloat16, "cpu", progress=False)
    assert model16.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    want = run_prompts(model32, PROMPTS[:1])[0]
    got = run_prompts(model16, PROMPTS[:1])[0]
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)

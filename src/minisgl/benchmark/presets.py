"""Model shapes for benchmarks with random weights: a preset name or a config.json, written out as a
model directory (config.json plus a synthetic tokenizer covering the vocabulary), so `LLM(dir,
dummy_weights=True)` runs a real architecture's shapes with no checkpoint and no download."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": _LLAMA3_ROPE,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 128,
    "num_key_value_heads": 8,
}
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": {  # Llama-3.1-8B
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    "llama3-70b": {  # Llama-3.1-70B
        **_LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
    "smollm2-135m": {  # SmolLM2-135M(-Instruct), the embedded model
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen3-30b-a3b": {  # Qwen3-30B-A3B: 128 experts, 8 per token, every layer sparse
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_act": "silu",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "mixtral-8x7b": {  # Mixtral-8x7B-v0.1: 8 experts, 2 per token
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_act": "silu",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def preset_config(name_or_path: str) -> dict[str, Any]:
    """A preset's config dict, or the contents of a config.json file (or of a model directory's)."""
    if name_or_path in PRESETS:
        return dict(PRESETS[name_or_path])
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model-config: {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def write_model_dir(config: dict[str, Any], out: Path) -> Path:
    """config.json and a word-level tokenizer with one token per id (`<0>`, `<1>`, ...) in `out`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    vocab = {f"<{i}>": i for i in range(int(config["vocab_size"]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>").save_pretrained(str(out))
    return out

"""The transformers model of a model directory, with the same weights: what tests and the offline
benchmark compare minisgl against. A safetensors directory loads as it is; a GGUF file's derived
directory gets its weights dequantized to float32 (`gguf_weights.hf_state_dict`), the same values
as minisgl's `--dtype float32`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from minisgl.checkpoint.gguf_weights import gguf_file_of, hf_state_dict

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def transformers_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """transformers' model of `model_dir` in `dtype`, in eval mode, on the CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    if gguf_file_of(model_dir) is None:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)), dtype=dtype)
    result = model.load_state_dict(hf_state_dict(model_dir, config), strict=False)
    missing = [
        n for n in result.missing_keys if not (n == "lm_head.weight" and config.get("tie_word_embeddings"))
    ]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{model_dir}: tensors missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    if config.get("tie_word_embeddings"):
        model.tie_weights()
    return model.eval()

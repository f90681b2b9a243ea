"""minisgl.models: model definitions (Llama, Mistral, Qwen2, Qwen3; the mixtures of experts Mixtral,
Qwen2-MoE, Qwen3-MoE) and weight loading (Hugging Face safetensors directories; GGUF files read in
place, their config and tokenizer derived once into a cached directory).

The names load on first access (PEP 562): `minisgl.models.resolve` (what the launcher and the
workers use) does not pull in torch through the model code."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minisgl.checkpoint.gguf_convert import GGUFConversionError
    from minisgl.checkpoint.weights import WeightLoadError
    from minisgl.models.base import CausalLM
    from minisgl.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelConfigError
    from minisgl.models.llama import LlamaForCausalLM
    from minisgl.models.loader import fill_dummy_weights, load_model
    from minisgl.models.resolve import embedded_gguf_path, resolve_model_path

_WHERE = {
    "CausalLM": "minisgl.models.base",
    "SUPPORTED_ARCHITECTURES": "minisgl.models.config",
    "ModelConfig": "minisgl.models.config",
    "ModelConfigError": "minisgl.models.config",
    "GGUFConversionError": "minisgl.checkpoint.gguf_convert",
    "LlamaForCausalLM": "minisgl.models.llama",
    "fill_dummy_weights": "minisgl.models.loader",
    "load_model": "minisgl.models.loader",
    "embedded_gguf_path": "minisgl.models.resolve",
    "resolve_model_path": "minisgl.models.resolve",
    "WeightLoadError": "minisgl.checkpoint.weights",
}
__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "GGUFConversionError",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelConfigError",
    "WeightLoadError",
    "embedded_gguf_path",
    "fill_dummy_weights",
    "load_model",
    "resolve_model_path",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'minisgl.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)

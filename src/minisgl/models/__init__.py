"""minisgl.models: model definitions (Llama, Mistral, Qwen2, Qwen3; the mixtures of experts Mixtral,
Qwen2-MoE, Qwen3-MoE) and weight loading (Hugging Face safetensors directories; GGUF files read in
place, their config and tokenizer derived once into a cached directory).

The names load on first access (PEP 562): `minisgl.models.resolve` (what the launcher and the
workers use) does not pull in torch through the model code."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minisgl.models.base import CausalLM
    from minisgl.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelConfigError
    from minisgl.models.gguf_convert import GGUFConversionError
    from minisgl.models.llama import LlamaForCausalLM
    from minisgl.models.loader import fill_dummy_weights, load_model
    from minisgl.models.resolve import embedded_gguf_path, resolve_model_path
    from minisgl.models.weights import WeightLoadError

_WHERE = {
    "CausalLM": "base",
    "SUPPORTED_ARCHITECTURES": "config",
    "ModelConfig": "config",
    "ModelConfigError": "config",
    "GGUFConversionError": "gguf_convert",
    "LlamaForCausalLM": "llama",
    "fill_dummy_weights": "loader",
    "load_model": "loader",
    "embedded_gguf_path": "resolve",
    "resolve_model_path": "resolve",
    "WeightLoadError": "weights",
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
    return getattr(importlib.import_module(f"minisgl.models.{_WHERE[name]}"), name)

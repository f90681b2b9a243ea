"""minisgl.models: model definitions (Llama, Mistral, Qwen2, Qwen3; the mixtures of experts Mixtral,
Qwen2-MoE, Qwen3-MoE) and weight loading (Hugging Face safetensors directories; GGUF files converted
once into a cached directory)."""

from minisgl.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelConfigError
from minisgl.models.gguf_convert import GGUFConversionError
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.loader import fill_dummy_weights, load_model
from minisgl.models.resolve import embedded_gguf_path, resolve_model_path
from minisgl.models.weights import WeightLoadError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
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

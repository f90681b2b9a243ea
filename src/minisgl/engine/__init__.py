"""minisgl.engine: one rank's model + KV pool + attention backend + sampler."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import TypedDict

import torch

from .dummy import DummyEngine
from .engine import Engine
from .interface import EngineProtocol
from .options import EngineOptions
from .sampler import Sampler
from .step import StepOutput

__all__ = [
    "DummyEngine",
    "Engine",
    "EngineOptions",
    "EngineProtocol",
    "Sampler",
    "StepOutput",
    "create_engine",
]

logger = logging.getLogger(__name__)


def create_engine(options: EngineOptions) -> EngineProtocol:
    """Build the engine `options` ask for (a SchedulerConfig is one); loads the model unless
    `engine == "dummy"`."""
    tp_info = options.tp_info
    if options.device == "cuda" and tp_info.size > 1:
        options = dataclasses.replace(options, device=f"cuda:{tp_info.rank}")
    if options.engine == "dummy":
        return DummyEngine(options, step_ms=options.dummy_step_ms, **_dummy_model_info(options.model_path))
    from minisgl.models import load_model, resolve_model_path

    model_dir = resolve_model_path(options.model_path, require_weights=not options.dummy_weights)
    model, model_config = load_model(
        model_dir,
        options.dtype,
        torch.device(options.device),
        tp_info=tp_info,
        dummy=options.dummy_weights,
        native=options.native_weights,
        quantization=options.quantization,
    )
    return Engine(model, model_config, options)


class _ModelInfo(TypedDict, total=False):
    """What the dummy engine takes from a model's config.json."""

    vocab_size: int
    eos_token_ids: list[int]
    max_position_embeddings: int


def _dummy_model_info(model_path: str) -> _ModelInfo:
    """Vocabulary size, EOS ids and context of the named model, read from its config.json only
    (the dummy engine must agree with the tokenizer); defaults when there is no such file."""
    try:
        from minisgl.models import resolve_model_path

        cfg = json.loads((Path(resolve_model_path(model_path)) / "config.json").read_text())
    except Exception as e:  # no model at all is fine for a dummy engine
        logger.info("dummy engine: no model config (%s); using default vocabulary size", e)
        return {}
    eos = cfg.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    info: _ModelInfo = {"vocab_size": int(cfg.get("vocab_size", 32000)), "eos_token_ids": eos_ids}
    if cfg.get("max_position_embeddings"):
        info["max_position_embeddings"] = int(cfg["max_position_embeddings"])
    return info

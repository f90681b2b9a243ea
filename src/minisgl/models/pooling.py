"""How a model's embeddings are pooled from its final hidden states, read from the model directory.

The pooling mode is sentence-transformers' (modules.json names the Pooling module, whose config.json
sets one `pooling_mode_*`): the last token (Qwen3-Embedding, and what a causal LM's last position
has seen: the default) or the mean over the prompt's tokens. The result is always L2-normalised.
`dimensions` (OpenAI's field) is allowed where the model is trained for truncation (Matryoshka):
config.json's `matryoshka_dimensions` (those sizes) or `is_matryoshka: true` (any size); the
truncated vector is normalised again. Plain JSON reads: no torch, no transformers.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minisgl.models.config import ModelConfigError

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

POOLING_MODES = ("last", "mean")
# sentence-transformers' pooling flags -> ours (the others are refused by name)
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class PoolingConfig:
    """mode: "last" or "mean"; hidden_size: the full embedding's length; matryoshka: the sizes
    `dimensions` may take (() for any from 1 to hidden_size, None for none but hidden_size)."""

    mode: str = "last"
    hidden_size: int = 0
    matryoshka: tuple[int, ...] | None = None

    def check_dimensions(self, dimensions: int) -> str | None:
        """Why `dimensions` cannot be served (None: it can)."""
        if dimensions == self.hidden_size:
            return None
        if self.matryoshka is None:
            return (
                f"this model's embeddings have {self.hidden_size} dimensions and it is not trained for "
                f"shorter ones (no matryoshka_dimensions in its config): dimensions must be {self.hidden_size}"
            )
        if not 1 <= dimensions <= self.hidden_size:
            return f"dimensions must be in 1..{self.hidden_size}, got {dimensions}"
        if self.matryoshka and dimensions not in self.matryoshka:
            sizes = ", ".join(map(str, self.matryoshka))
            return f"this model's embeddings may be truncated to {sizes} dimensions, not {dimensions}"
        return None


def embedding_vector(raw: bytes, dimensions: int | None = None) -> np.ndarray:
    """A pooled hidden state as it travels (float32 bytes) -> the embedding: its first `dimensions`
    values (Matryoshka truncation; None: all), L2-normalised (float32, (D,)). numpy loads on the first
    call: the API server, which imports this module, does without it (16 MB) until it serves one."""
    import numpy as np

    v = np.frombuffer(raw, dtype=np.float32)[:dimensions]
    return v / max(float(np.linalg.norm(v)), 1e-12)  # (torch.nn.functional.normalize's eps)


def read_pooling(model_dir: str | Path, strict: bool = True) -> PoolingConfig:
    """The directory's pooling (see the module docstring). A pooling mode that minisgl does not
    compute is a ModelConfigError if `strict` (an embedding model), else logged and replaced by the
    last token (a generative model whose embeddings are a side use)."""
    path = Path(model_dir)
    config = _json(path / "config.json") or {}
    hidden = config.get("hidden_size")
    try:
        mode = _sentence_transformers_mode(path) or "last"
    except ModelConfigError as e:
        if strict:
            raise
        logger.warning("%s; embeddings pool the last token", e)
        mode = "last"
    return PoolingConfig(mode, hidden if isinstance(hidden, int) else 0, _matryoshka(config))


def _sentence_transformers_mode(path: Path) -> str | None:
    modules = _json(path / "modules.json")
    if not isinstance(modules, list):
        return None
    for m in modules:
        if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
            cfg = _json(path / str(m.get("path", "")) / "config.json") or {}
            on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
            if not on:
                return None
            if len(on) > 1 or on[0] not in _ST_MODES:
                raise ModelConfigError(
                    f"{path / str(m.get('path', ''))}: pooling {', '.join(on)} is not supported "
                    "(pooling_mode_lasttoken or pooling_mode_mean_tokens)"
                )
            return _ST_MODES[on[0]]
    return None


def _matryoshka(config: dict[str, Any]) -> tuple[int, ...] | None:
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
        return tuple(sorted(dims))
    return () if config.get("is_matryoshka") is True else None


def _json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path}: cannot read JSON: {e}") from None

"""minisgl: a compact, fast LLM serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minisgl.core import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from minisgl.llm import LLM


def __getattr__(name: str) -> Any:
    # `LLM` pulls in torch models and the scheduler: import it only when asked for.
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    raise AttributeError(f"module 'minisgl' has no attribute {name!r}")

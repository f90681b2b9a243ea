"""minisgl: a compact, fast LLM serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM


def __getattr__(name: str) -> Any:
    # Both names pull in torch (and `LLM` the models and the scheduler): import them only when
    # asked for, so that `minisgl --help` and the benchmark client start quickly.
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    if name == "SamplingParams":
        from minisgl.core import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'minisgl' has no attribute {name!r}")

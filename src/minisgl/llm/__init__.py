"""minisgl.llm: the offline `LLM` class (a scheduler in offline mode)."""

from .llm import LLM

__all__ = ["LLM"]

"""minisgl.llm: the offline `LLM` class (a scheduler in offline mode; `tp=N` starts N ranks)."""

from .llm import LLM
from .ranks import MultiRankLLM, RankFailed

__all__ = ["LLM", "MultiRankLLM", "RankFailed"]

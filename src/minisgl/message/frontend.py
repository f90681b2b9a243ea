"""Messages to the API server (the frontend)."""

from __future__ import annotations

from dataclasses import dataclass

from .codec import Message


@dataclass
class BaseFrontendMsg(Message, group="frontend"):
    pass


@dataclass
class BatchFrontendMsg(BaseFrontendMsg):
    data: list[BaseFrontendMsg]


@dataclass
class UserReply(BaseFrontendMsg):
    """New text of request `uid`. The last reply has finished=True, a finish_reason
    ("stop", "length", "abort", "error") and the token counts; `error` says why on a rejection.
    cached_tokens: prompt tokens served from the prefix cache (0 when absent)."""

    uid: int
    incremental_output: str
    finished: bool
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    cached_tokens: int = 0

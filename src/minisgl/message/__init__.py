"""The three message groups (by receiver) and their codec."""

from .backend import AbortBackendMsg, BaseBackendMsg, BatchBackendMsg, ExitMsg, UserMsg
from .codec import MessageDecodeError
from .frontend import BaseFrontendMsg, BatchFrontendMsg, LoadReply, ReplyReasoning, UserReply, UserReplyExtra
from .tokenizer import (
    AbortMsg,
    BaseTokenizerMsg,
    BatchTokenizerMsg,
    DetokenizeExtra,
    DetokenizeMsg,
    ErrorMsg,
    LoadMsg,
    TokenizeMsg,
)

__all__ = [
    "AbortBackendMsg",
    "AbortMsg",
    "BaseBackendMsg",
    "BaseFrontendMsg",
    "BaseTokenizerMsg",
    "BatchBackendMsg",
    "BatchFrontendMsg",
    "BatchTokenizerMsg",
    "DetokenizeExtra",
    "DetokenizeMsg",
    "ErrorMsg",
    "ExitMsg",
    "LoadMsg",
    "LoadReply",
    "MessageDecodeError",
    "TokenizeMsg",
    "UserMsg",
    "UserReply",
    "ReplyReasoning",
    "UserReplyExtra",
]

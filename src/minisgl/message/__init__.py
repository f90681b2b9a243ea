"""The three message groups (by receiver) and their codec."""

from .backend import AbortBackendMsg, BaseBackendMsg, BatchBackendMsg, ExitMsg, UserMsg
from .codec import MessageDecodeError
from .frontend import BaseFrontendMsg, BatchFrontendMsg, UserReply
from .tokenizer import AbortMsg, BaseTokenizerMsg, BatchTokenizerMsg, DetokenizeMsg, ErrorMsg, TokenizeMsg

__all__ = [
    "AbortBackendMsg",
    "AbortMsg",
    "BaseBackendMsg",
    "BaseFrontendMsg",
    "BaseTokenizerMsg",
    "BatchBackendMsg",
    "BatchFrontendMsg",
    "BatchTokenizerMsg",
    "DetokenizeMsg",
    "ErrorMsg",
    "ExitMsg",
    "MessageDecodeError",
    "TokenizeMsg",
    "UserMsg",
    "UserReply",
]

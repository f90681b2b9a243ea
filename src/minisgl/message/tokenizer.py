"""Messages to the tokenizer / detokenizer workers."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.core import SamplingParams

from .codec import Message


@dataclass
class BaseTokenizerMsg(Message, group="tokenizer"):
    pass


@dataclass
class BatchTokenizerMsg(BaseTokenizerMsg):
    data: list[BaseTokenizerMsg]


@dataclass
class TokenizeMsg(BaseTokenizerMsg):
    """From the API server: a prompt (text, chat messages, or token ids) to tokenize once and
    schedule as `n` requests (choices), uids `uid .. uid + n - 1`; choice i samples with seed + i
    when a seed is given."""

    uid: int
    text: str | list[dict[str, str]] | list[int]
    sampling_params: SamplingParams
    n: int = 1


@dataclass
class DetokenizeMsg(BaseTokenizerMsg):
    """From the scheduler: one new token of request `uid`. finish_reason: "", "stop", "length", "abort".
    cached_tokens: prompt tokens whose K/V came from the prefix cache (usage; 0 when absent)."""

    uid: int
    next_token: int
    finished: bool
    finish_reason: str = ""
    cached_tokens: int = 0


@dataclass
class AbortMsg(BaseTokenizerMsg):
    uid: int


@dataclass
class ErrorMsg(BaseTokenizerMsg):
    """From the scheduler: request `uid` was rejected (e.g. longer than the context); says why."""

    uid: int
    message: str

"""Messages to the tokenizer / detokenizer workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

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
    when a seed is given. replica: the data-parallel replica (--dp) the API server routed it to."""

    uid: int
    text: str | list[dict[str, str]] | list[int]
    sampling_params: SamplingParams
    n: int = 1
    replica: int = 0
    # Chat prompts: end with the assistant's turn opened, or continue the last (assistant) message.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # acknowledge with the prompt's text (`echo` of a token-id prompt)
    # Tool calling: the tools for the chat template (a JSON list, "" for none). A chat message's
    # values are strings: an assistant's "tool_calls" is their JSON text.
    tools: str = ""
    # The request's own chat template ("": the model's) and the variables it passes to the template
    # (a JSON object, "" for none: chat_template_kwargs, documents, reasoning_effort).
    chat_template: str = ""
    template_kwargs: str = ""


@dataclass
class DetokenizeExtra:
    """The rare fields of a DetokenizeMsg, sent (as its `extra`) only with a token that has one.
    cached_tokens: prompt tokens whose K/V came from the prefix cache (usage), on a request's first
    token and on an abort; stop_token_id: the stop token id (not EOS) that ended the request."""

    omit_defaults: ClassVar[bool] = True
    cached_tokens: int = 0
    stop_token_id: int = -1
    # With sampling_params.logprobs: the token's log probability and the top alternatives.
    logprob: float | None = None
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    # With prompt_logprobs, on the first token only: every prompt token, then per prompt token after
    # the first its log probability and top alternatives.
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_ids: list[list[int]] = field(default_factory=list)
    prompt_top_logprobs: list[list[float]] = field(default_factory=list)
    # An embedding request's answer (its only message, next_token -1): the pooled final hidden state
    # as the bytes of a float32 array (H,), native byte order; not yet normalised.
    embedding: bytes = b""
    # On the last token of a reasoning model's chat answer: how many were its reasoning.
    reasoning_tokens: int = 0
    return_token: bool = False  # the reply carries the token's id (sampling_params.return_token_ids)


@dataclass
class DetokenizeMsg(BaseTokenizerMsg):
    """From the scheduler: one new token of request `uid` (-1: none, as in an abort's reply).
    finish_reason: "", "stop", "length", "abort". A plain token is the chapters' three fields on the
    wire: the others are left out at their defaults, the rare ones grouped in `extra`."""

    omit_defaults: ClassVar[bool] = True
    uid: int
    next_token: int
    finished: bool
    finish_reason: str = ""
    extra: DetokenizeExtra | None = None


@dataclass
class AbortMsg(BaseTokenizerMsg):
    """From the API server: stop request `uid`, held by data-parallel replica `replica`."""

    uid: int
    replica: int = 0


@dataclass
class LoadMsg(BaseTokenizerMsg):
    """From scheduler rank 0 of replica `replica`, whenever its counts change: requests running
    (prefilling or decoding) and waiting for KV pages. The detokenizer forwards it as a LoadReply."""

    replica: int
    running: int
    waiting: int


@dataclass
class ErrorMsg(BaseTokenizerMsg):
    """From the scheduler: request `uid` was rejected (e.g. longer than the context); says why."""

    uid: int
    message: str

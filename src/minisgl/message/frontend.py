"""Messages to the API server (the frontend)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .codec import Message


@dataclass
class BaseFrontendMsg(Message, group="frontend"):
    pass


@dataclass
class BatchFrontendMsg(BaseFrontendMsg):
    data: list[BaseFrontendMsg]


@dataclass
class ReplyReasoning:
    """A reasoning model's chat answer: `mode` in the acknowledgement, where the answer starts
    ("inside" its reasoning, reasoning "optional", or "off"); `tokens` on the last reply, how many of
    its tokens were reasoning."""

    omit_defaults: ClassVar[bool] = True
    mode: str = ""
    tokens: int = 0


@dataclass
class UserReplyExtra:
    """The rare fields of a UserReply, sent (as its `extra`) only with a reply that has one.
    cached_tokens: prompt tokens served from the prefix cache; stop_token_id: the stop token id (not
    EOS) that ended the request; prompt_text: the decoded prompt, in the acknowledgement of a request
    with echo."""

    omit_defaults: ClassVar[bool] = True
    cached_tokens: int = 0
    stop_token_id: int = -1
    prompt_text: str = ""
    # Logprobs of this reply's token (if asked for): its bytes, log probability and alternatives.
    lp_tokens: list[bytes] = field(default_factory=list)
    lp_values: list[float] = field(default_factory=list)
    lp_top_tokens: list[list[bytes]] = field(default_factory=list)
    lp_top_values: list[list[float]] = field(default_factory=list)
    # Prompt logprobs (first reply only): every prompt token's bytes; for each one after the first
    # its log probability and alternatives.
    prompt_lp_tokens: list[bytes] = field(default_factory=list)
    prompt_lp_values: list[float] = field(default_factory=list)
    prompt_lp_top_tokens: list[list[bytes]] = field(default_factory=list)
    prompt_lp_top_values: list[list[float]] = field(default_factory=list)
    # An embedding request's answer: the pooled hidden state, float32 bytes (DetokenizeExtra's).
    embedding: bytes = b""
    # Reasoning models: where the answer starts (acknowledgement), how many tokens were reasoning
    # (last reply). One nested record for both: 15 fields at most keep this record a fixmap on the
    # wire (msgspec sizes the header by the fields declared, not by those sent).
    reasoning: ReplyReasoning | None = None
    # With sampling_params.return_token_ids: in the acknowledgement the prompt's ids, in a reply
    # its token's. (One field for both, for the same reason.)
    token_ids: list[int] = field(default_factory=list)


@dataclass
class UserReply(BaseFrontendMsg):
    """New text of request `uid`. The last reply has finished=True, a finish_reason
    ("stop", "length", "abort", "error") and the token counts; `error` says why on a rejection.
    Fields at their defaults stay off the wire; the rare ones are grouped in `extra`."""

    omit_defaults: ClassVar[bool] = True
    uid: int
    incremental_output: str
    finished: bool
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    extra: UserReplyExtra | None = None


@dataclass
class LoadReply(BaseFrontendMsg):
    """A replica's load (see LoadMsg): what the API server routes new requests by."""

    replica: int
    running: int
    waiting: int

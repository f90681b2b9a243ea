"""What a request stream hands its HTTP handler: `Chunk`s of text with their token counts, finish
reason and logprobs (`TokenLogprob`, gathered from the replies' extras by `LogprobBuffer`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.frontend.errors import RequestError
from minisgl.message import UserReplyExtra


@dataclass
class TokenLogprob:
    """One token's log probability (None: the prompt's first token) and its top alternatives."""

    token: bytes
    logprob: float | None
    top: list[tuple[bytes, float]] = field(default_factory=list)


@dataclass
class Chunk:
    """New output of one request: text, and finish_reason once it is done; `stop_reason` the stop
    string or stop token id that ended it (None otherwise); the logprobs of its tokens (if asked
    for), after those of the prompt's tokens on the first chunk of a request with prompt logprobs."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    error: RequestError | None = None  # why, when finish_reason is "error" (after some output)
    reasoning: str = ""  # a reasoning model's chat answer: where it starts (UserReplyExtra.reasoning)
    token_ids: list[int] = field(default_factory=list)  # with return_token_ids: this chunk's tokens


class LogprobBuffer:
    """The logprobs that arrived since the last chunk: each token's, and once the prompt's."""

    def __init__(self) -> None:
        self.tokens: list[TokenLogprob] = []
        self.prompt: list[TokenLogprob] | None = None

    def add(self, extra: UserReplyExtra) -> None:
        self.tokens += _reply_logprobs(extra)
        if extra.prompt_lp_tokens:
            self.prompt = _prompt_logprobs(extra)

    def take(self) -> tuple[list[TokenLogprob], list[TokenLogprob] | None]:
        """(the tokens' logprobs, the prompt's or None) since the last take."""
        out = (self.tokens, self.prompt)
        self.tokens, self.prompt = [], None
        return out


def _reply_logprobs(r: UserReplyExtra) -> list[TokenLogprob]:
    return [
        TokenLogprob(tok, lp, list(zip(top, top_lp, strict=True)))
        for tok, lp, top, top_lp in zip(
            r.lp_tokens, r.lp_values, r.lp_top_tokens, r.lp_top_values, strict=True
        )
    ]


def _prompt_logprobs(r: UserReplyExtra) -> list[TokenLogprob]:
    """Every prompt token; the first has no logprob."""
    tokens = r.prompt_lp_tokens
    out = [TokenLogprob(tokens[0], None)] if tokens else []
    rows = zip(tokens[1:], r.prompt_lp_values, r.prompt_lp_top_tokens, r.prompt_lp_top_values, strict=True)
    out += [TokenLogprob(tok, lp, list(zip(top, top_lp, strict=True))) for tok, lp, top, top_lp in rows]
    return out

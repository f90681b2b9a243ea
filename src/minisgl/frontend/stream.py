"""One request (one choice) in flight in the API server: its replies as they arrive, turned into
`Chunk`s for its HTTP handler, with the request's stop strings matched here (a match aborts the
request upstream), the echo of its prompt, its logprobs and usage (`chunk.py`, `usage.py`), and the
race of a tokenizer's acknowledgement overtaken by the detokenizer's last reply.

Reply protocol (see `minisgl.tokenizer.server`): the tokenizer answers each request first with
`UserReply("", finished=False, prompt_tokens=n)` or a rejection (`finished=True,
finish_reason="error", error=...`); then the detokenizer sends text with the running completion
token count; the last reply has `finished=True` and "stop", "length", "abort" or "error".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from minisgl.frontend.chunk import Chunk, LogprobBuffer
from minisgl.frontend.errors import RequestError
from minisgl.frontend.usage import StreamUsage
from minisgl.grammar import GRAMMAR_REFUSED
from minisgl.message import UserReply, UserReplyExtra
from minisgl.tokenizer.stop import StopMatcher

if TYPE_CHECKING:
    from minisgl.frontend.manager import FrontendManager

# How long a finished request waits for its prompt-token count if that reply (from a tokenizer
# process) is overtaken by the detokenizer's last reply; only possible with --num-tokenizer > 0.
_LATE_ACK_WAIT_S = 1.0


class RequestStream:
    """One request (one choice) in flight: its replies as they arrive, and its stop strings."""

    def __init__(
        self,
        manager: FrontendManager,
        uid: int,
        stops: list[str],
        replica: int = 0,
        echo: bool = False,
        include_stop: bool = False,
    ) -> None:
        self.manager = manager
        self.uid = uid
        self.replica = replica  # the data-parallel replica that serves it
        self.matcher = StopMatcher(stops, include_stop)
        self.echo = echo  # the first chunk starts with the prompt's text
        self.prompt_text = ""
        self.stop_token_id = -1
        self.embedding = b""  # an embedding request's answer: the pooled state, float32 bytes
        self.reasoning = ""  # a reasoning model's chat answer: where it starts ("inside", ...)
        self.reasoning_tokens = 0
        self.prompt_token_ids: list[int] = []  # with return_token_ids (from the acknowledgement)
        self._token_ids: list[int] = []  # ... and the new tokens' since the last chunk
        self._logprobs = LogprobBuffer()
        self.usage = StreamUsage(manager.metrics, lambda: manager.mark_running(uid))
        self.finish_reason: str | None = None
        self.error: RequestError | None = None  # why it ended with "error" after some output
        # The request field its grammar came from: named when the scheduler refuses the grammar.
        self.grammar_field: str | None = None
        self._replies: list[UserReply] = []
        self._event = asyncio.Event()
        self.t_first_reply: float | None = None  # time.monotonic() of the first reply (the watchdog's)
        self.deadline: asyncio.TimerHandle | None = None  # --request-timeout

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens

    @property
    def cached_tokens(self) -> int:
        return self.usage.cached_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, reply: UserReply) -> None:
        if self.t_first_reply is None:
            self.t_first_reply = time.monotonic()
        self._replies.append(reply)
        self._event.set()

    async def _wait(self) -> None:
        while not self._replies:
            self._event.clear()
            await self._event.wait()

    async def accepted(self) -> None:
        """Wait for the tokenizer's verdict; raise RequestError if the request was rejected."""
        await self._wait()
        first = self._replies[0]
        if first.finished and first.finish_reason == "error":
            self._take()  # records the error, closes the stream and raises RequestError
        if first.extra is not None and first.prompt_tokens:  # what the acknowledgement tells first
            self._take_ack(first.extra)

    async def started(self) -> None:
        """Wait until the request has output or has ended; raise RequestError if it was refused
        before any output (a grammar that does not compile), so that the answer can still be a 400."""
        while not any(r.finished or r.completion_tokens for r in self._replies):
            self._event.clear()
            await self._event.wait()
        first = next(r for r in self._replies if r.finished or r.completion_tokens)
        if first.finished and first.finish_reason == "error" and not first.completion_tokens:
            self._take()

    def _take(self) -> str:
        """Absorb the pending replies: counts, finish state, metrics; return their text."""
        replies, self._replies = self._replies, []
        text: list[str] = []
        for r in replies:
            self.usage.count_prompt(r.prompt_tokens)
            if (
                r.finished
                and r.finish_reason == "error"
                and not max(r.completion_tokens, self.completion_tokens)
            ):
                self._finish("error")
                raise self._error(r)
            self.usage.count_tokens(r.completion_tokens)
            text.append(r.incremental_output)
            if r.extra is not None:
                self._take_extra(r.extra, r.finished, bool(r.prompt_tokens))
            if r.finished:
                self.finish_reason = r.finish_reason or "stop"
                if self.finish_reason == "error":  # after some output: the choice ends with it
                    self.error = self._error(r)
                break
        return "".join(text)

    def _error(self, r: UserReply) -> RequestError:
        """The error of a failed reply: the client's (400) unless it came after output for another
        reason than its grammar (500)."""
        why = r.error or "request failed"
        grammar = self.grammar_field is not None and why.startswith(GRAMMAR_REFUSED)
        status = 400 if grammar or not (r.completion_tokens or self.completion_tokens) else 500
        return RequestError(why, status, self.grammar_field if grammar else None)

    def _take_extra(self, x: UserReplyExtra, finished: bool, ack: bool) -> None:
        """A reply's rare fields: the echo's prompt text, the prefix-cache usage, logprobs, an
        embedding, and on the last reply the stop token id."""
        if ack:
            self._take_ack(x)
        else:
            self._token_ids += x.token_ids
        self.embedding = self.embedding or x.embedding
        if x.reasoning is not None:
            self.reasoning_tokens = max(self.reasoning_tokens, x.reasoning.tokens)
        self.usage.count_cached(x.cached_tokens)
        self._logprobs.add(x)
        if finished:
            self.stop_token_id = x.stop_token_id

    def _take_ack(self, x: UserReplyExtra) -> None:
        """The tokenizer's acknowledgement: the echo's text, where a reasoning answer starts, the
        prompt's ids (return_token_ids)."""
        self.prompt_text = self.prompt_text or x.prompt_text
        self.reasoning = self.reasoning or (x.reasoning.mode if x.reasoning is not None else "")
        self.prompt_token_ids = self.prompt_token_ids or x.token_ids

    async def next_chunk(self) -> Chunk:
        """The text that arrived since the last call (waits for some), with stop strings applied."""
        await self._wait()
        text = self._take()
        res = self.matcher.feed(text)
        text = res.text
        if res.matched is not None:
            self.finish_reason = "stop"
        elif self.finished:
            text += self.matcher.flush()
        if self.finished:
            if not self.usage.acked:
                await self._late_ack()
            if res.matched is not None:
                self.manager.abort(self.uid)  # the scheduler stops generating and frees the pages
            self._finish(self.finish_reason or "stop")
        if self.echo and self.prompt_text and (self.completion_tokens or self.finished):
            # with the first output: its prompt logprobs come with the first token
            text, self.echo = self.prompt_text + text, False
        stop_reason = res.matched if res.matched is not None else self._stop_token()
        logprobs, prompt_logprobs = self._logprobs.take()
        token_ids, self._token_ids = self._token_ids, []
        return Chunk(
            text,
            self.finish_reason,
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
            stop_reason,
            logprobs,
            prompt_logprobs,
            self.error if self.finish_reason == "error" else None,
            self.reasoning,
            token_ids,
        )

    def _stop_token(self) -> int | None:
        return self.stop_token_id if self.finish_reason == "stop" and self.stop_token_id >= 0 else None

    async def chunks(self) -> AsyncIterator[Chunk]:
        while not self.finished:
            chunk = await self.next_chunk()
            if (
                chunk.text
                or chunk.finish_reason is not None
                or chunk.logprobs
                or chunk.prompt_logprobs
                or chunk.token_ids
            ):
                yield chunk

    async def _late_ack(self) -> None:
        try:
            await asyncio.wait_for(self._wait(), _LATE_ACK_WAIT_S)
        except asyncio.TimeoutError:
            return
        for r in self._replies:
            self.usage.count_prompt(r.prompt_tokens)
            if r.extra is not None and r.prompt_tokens:
                self._take_ack(r.extra)
        self._replies = []

    def _finish(self, reason: str) -> None:
        if self.finish_reason is None or reason == "error":
            self.finish_reason = reason
        self.usage.finished(self.finish_reason)
        self.manager.close(self.uid)

"""The API server's side of the pipes: request ids, outgoing messages, and routing of replies.

One asyncio task (`listen`) pulls `UserReply` messages and appends each to the `RequestStream` of
its uid; one task (`_send_loop`) pushes `TokenizeMsg`/`AbortMsg` to the tokenizer(s), batching what
queued up meanwhile. Everything an HTTP handler does is therefore synchronous (`open`, `close`) or
an await on its own stream, so a handler cancelled by a disconnect can always clean up.

Reply protocol (see `minisgl.tokenizer.server`): the tokenizer answers each request first with
`UserReply("", finished=False, prompt_tokens=n)` or a rejection (`finished=True,
finish_reason="error", error=...`); then the detokenizer sends text with the running completion
token count; the last reply has `finished=True` and "stop", "length" or "abort". Stop strings are
matched here (the request's stop list is known here), and a match aborts the request upstream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from minisgl.core import SamplingParams
from minisgl.frontend.metrics import ServerMetrics
from minisgl.frontend.router import ReplicaRouter
from minisgl.grammar import GRAMMAR_REFUSED
from minisgl.message import (
    AbortMsg,
    BaseFrontendMsg,
    BaseTokenizerMsg,
    BatchFrontendMsg,
    BatchTokenizerMsg,
    LoadReply,
    TokenizeMsg,
    UserReply,
    UserReplyExtra,
)
from minisgl.tokenizer.stop import StopMatcher

logger = logging.getLogger("minisgl.server")

# A prompt as the tokenizer takes it: text, token ids, or chat messages (it applies the template).
TokenizerPrompt = str | list[int] | list[dict[str, str]]

# How long a finished request waits for its prompt-token count if that reply (from a tokenizer
# process) is overtaken by the detokenizer's last reply; only possible with --num-tokenizer > 0.
_LATE_ACK_WAIT_S = 1.0


@dataclass(frozen=True)
class PromptOptions:
    """How the tokenizer renders a prompt (chat) and whether the answer echoes it (completions)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    tools: str = ""  # JSON list of the tools the chat template renders ("" for none)


class RequestError(Exception):
    """A request the workers rejected or could not finish; `status` is the HTTP status to answer
    with, `param` the request field at fault (None: not one field)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"


class Overloaded(Exception):
    """More requests in flight than --max-queued-requests allows."""


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


class RequestStream:
    """One request (one choice) in flight: its replies as they arrive, and its stop strings."""

    def __init__(
        self, manager: FrontendManager, uid: int, stops: list[str], replica: int = 0, echo: bool = False
    ) -> None:
        self.manager = manager
        self.uid = uid
        self.replica = replica  # the data-parallel replica that serves it
        self.matcher = StopMatcher(stops)
        self.echo = echo  # the first chunk starts with the prompt's text
        self.prompt_text = ""
        self.stop_token_id = -1
        self._logprobs: list[TokenLogprob] = []
        self._prompt_logprobs: list[TokenLogprob] | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the scheduler took from its prefix cache
        self.finish_reason: str | None = None
        self.error: RequestError | None = None  # why it ended with "error" after some output
        # The request field its grammar came from: named when the scheduler refuses the grammar.
        self.grammar_field: str | None = None
        self._replies: list[UserReply] = []
        self._event = asyncio.Event()
        self._acked = False
        self.t_start = time.perf_counter()
        self._t_last: float | None = None
        self.t_first_reply: float | None = None  # time.monotonic() of the first reply (the watchdog's)
        self.deadline: asyncio.TimerHandle | None = None  # --request-timeout

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
            self._count_prompt(r.prompt_tokens)
            if (
                r.finished
                and r.finish_reason == "error"
                and not max(r.completion_tokens, self.completion_tokens)
            ):
                self._finish("error")
                raise self._error(r)
            self._count_tokens(r.completion_tokens)
            text.append(r.incremental_output)
            if r.extra is not None:
                self._take_extra(r.extra, r.finished)
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

    def _take_extra(self, x: UserReplyExtra, finished: bool) -> None:
        """A reply's rare fields: the echo's prompt text, the prefix-cache usage, logprobs, and on
        the last reply the stop token id."""
        self.prompt_text = self.prompt_text or x.prompt_text
        self._count_cached(x.cached_tokens)
        self._logprobs += _reply_logprobs(x)
        if x.prompt_lp_tokens:
            self._prompt_logprobs = _prompt_logprobs(x)
        if finished:
            self.stop_token_id = x.stop_token_id

    def _count_prompt(self, prompt_tokens: int) -> None:
        """The tokenizer's prompt-token count (in its first reply), taken once."""
        if prompt_tokens and not self._acked:
            self._acked = True
            self.prompt_tokens = prompt_tokens
            self.manager.metrics.prompt_tokens += prompt_tokens

    def _count_tokens(self, total: int) -> None:
        new = total - self.completion_tokens
        if new <= 0:
            return
        now = time.perf_counter()
        m = self.manager.metrics
        if self._t_last is None:
            m.ttft.observe(now - self.t_start)
            self.manager.mark_running(self.uid)
            new_itl, gap = new - 1, 0.0
        else:
            new_itl, gap = new, (now - self._t_last) / new
        if new_itl:
            m.itl.observe(gap, new_itl)
        m.generation_tokens += new
        self._t_last = now
        self.completion_tokens = total

    def _count_cached(self, cached: int) -> None:
        if cached > self.cached_tokens:
            self.manager.metrics.cached_prompt_tokens += cached - self.cached_tokens
            self.cached_tokens = cached

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
            if not self._acked:
                await self._late_ack()
            if res.matched is not None:
                self.manager.abort(self.uid)  # the scheduler stops generating and frees the pages
            self._finish(self.finish_reason or "stop")
        if self.echo and self.prompt_text:
            text, self.echo = self.prompt_text + text, False
        stop_reason = res.matched if res.matched is not None else self._stop_token()
        logprobs, self._logprobs = self._logprobs, []
        prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
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
        )

    def _stop_token(self) -> int | None:
        return self.stop_token_id if self.finish_reason == "stop" and self.stop_token_id >= 0 else None

    async def chunks(self) -> AsyncIterator[Chunk]:
        while not self.finished:
            chunk = await self.next_chunk()
            if chunk.text or chunk.finish_reason is not None or chunk.logprobs or chunk.prompt_logprobs:
                yield chunk

    async def _late_ack(self) -> None:
        try:
            await asyncio.wait_for(self._wait(), _LATE_ACK_WAIT_S)
        except asyncio.TimeoutError:
            return
        for r in self._replies:
            self._count_prompt(r.prompt_tokens)
        self._replies = []

    def _finish(self, reason: str) -> None:
        if self.finish_reason is None or reason == "error":
            self.finish_reason = reason
        m = self.manager.metrics
        m.finished[self.finish_reason] += 1
        m.e2e.observe(time.perf_counter() - self.t_start)
        self.manager.close(self.uid)


class FrontendManager:
    """Routes replies to request streams; sends requests and aborts to the tokenizer(s)."""

    def __init__(
        self,
        send: Callable[[BaseTokenizerMsg], Awaitable[None]],
        metrics: ServerMetrics | None = None,
        max_queued_requests: int | None = None,
        router: ReplicaRouter | None = None,
        request_timeout: float | None = None,
    ) -> None:
        self._send = send
        self.metrics = metrics or ServerMetrics()
        self.router = router or ReplicaRouter(1)
        self.metrics.registry.register(self.router)
        self.max_queued_requests = max_queued_requests
        self.request_timeout = request_timeout  # seconds from open() to "abort" (None: no deadline)
        self.streams: dict[int, RequestStream] = {}
        self._uids = itertools.count()
        self._outbox: asyncio.Queue[BaseTokenizerMsg] | None = None
        self._tasks: list[asyncio.Task] = []
        self._started: set[int] = set()  # uids past their first token (for the running gauge)

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self, recv: Callable[[], Awaitable[BaseFrontendMsg]]) -> None:
        """Start the send and listen tasks on the running event loop."""
        self._outbox = asyncio.Queue()
        self._tasks = [
            asyncio.create_task(self._send_loop(), name="frontend-send"),
            asyncio.create_task(self.listen(recv), name="frontend-listen"),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    # ---- requests --------------------------------------------------------------------------------

    def open(
        self,
        prompt: TokenizerPrompt,
        params: SamplingParams,
        stops: list[str],
        n: int = 1,
        options: PromptOptions | None = None,
    ) -> list[RequestStream]:
        """Register `n` choices of one prompt (consecutive uids, tokenized once) and queue them for
        the tokenizer; raises Overloaded when they do not fit under --max-queued-requests now."""
        opts = options or PromptOptions()
        self.check_room(n)
        first = next(self._uids)
        for _ in range(n - 1):
            next(self._uids)
        replica = self.router.pick(n)
        streams = [RequestStream(self, first + i, stops, replica, opts.echo) for i in range(n)]
        for s in streams:
            self.streams[s.uid] = s
            if self.request_timeout is not None:
                s.deadline = asyncio.get_running_loop().call_later(self.request_timeout, self._expire, s)
        self.metrics.waiting += n
        msg = TokenizeMsg(
            uid=first, text=prompt, sampling_params=params, n=n, replica=replica, echo=opts.echo
        )
        msg.add_generation_prompt = opts.add_generation_prompt
        msg.continue_final_message = opts.continue_final_message
        msg.tools = opts.tools
        self._post(msg)
        return streams

    def check_room(self, count: int) -> None:
        """Overloaded if `count` more requests do not fit under --max-queued-requests now;
        RequestError (400) if they never could, since waiting would not help."""
        limit = self.max_queued_requests
        if limit is None:
            return
        if count > limit:
            raise RequestError(
                f"this request needs {count} requests (prompts x n), more than the server holds "
                f"in flight ({limit}, --max-queued-requests)"
            )
        if len(self.streams) + count > limit:
            raise Overloaded(f"{len(self.streams)} requests in flight (--max-queued-requests {limit})")

    def close(self, uid: int) -> None:
        """Forget a request (finished, or about to be aborted); idempotent."""
        stream = self.streams.pop(uid, None)
        if stream is None:
            return
        if stream.deadline is not None:
            stream.deadline.cancel()
        if uid in self._started:
            self._started.discard(uid)
            self.metrics.running -= 1
        else:
            self.metrics.waiting -= 1

    def abort(self, uid: int) -> None:
        """Stop a request: the scheduler (of the replica that holds it) drops it and frees its pages."""
        stream = self.streams.get(uid)
        replica = stream.replica if stream is not None else 0
        self.close(uid)
        self._post(AbortMsg(uid=uid, replica=replica))

    def release(self, stream: RequestStream) -> None:
        """End of an HTTP handler's use of `stream`: abort it unless it finished."""
        if stream.uid in self.streams and not stream.finished:
            logger.info("request %d aborted (client gone or request cancelled)", stream.uid)
            self.abort(stream.uid)
        else:
            self.close(stream.uid)

    def finish_all(self, reason: str) -> None:
        """End every request in flight with `reason` (the server is stopping or a worker died)."""
        for stream in list(self.streams.values()):
            _end(stream, reason)

    def _expire(self, stream: RequestStream) -> None:
        """--request-timeout passed: the client gets "abort" now, the scheduler drops the request."""
        if self.streams.get(stream.uid) is not stream or stream.finished:
            return
        logger.info(
            "request %d aborted: it ran past --request-timeout (%g s)", stream.uid, self.request_timeout
        )
        _end(stream, "abort")
        self._post(AbortMsg(uid=stream.uid, replica=stream.replica))

    def first_accepted_after(self, replica: int, after: float) -> float | None:
        """The earliest first-reply time later than `after` (time.monotonic()) of a request on
        `replica` still in flight: work that rank has not come round to since (the watchdog's)."""
        times = [
            s.t_first_reply
            for s in self.streams.values()
            if s.replica == replica and s.t_first_reply is not None and s.t_first_reply > after
        ]
        return min(times, default=None)

    def mark_running(self, uid: int) -> None:
        """Request `uid` produced its first token: it moves from waiting to running."""
        if uid in self.streams and uid not in self._started:
            self._started.add(uid)
            self.metrics.waiting -= 1
            self.metrics.running += 1

    # ---- plumbing --------------------------------------------------------------------------------

    def _post(self, msg: BaseTokenizerMsg) -> None:
        if self._outbox is None:
            raise RuntimeError("FrontendManager.start() was not called")
        self._outbox.put_nowait(msg)

    async def _send_loop(self) -> None:
        assert self._outbox is not None
        while True:
            msgs = [await self._outbox.get()]
            while not self._outbox.empty():
                msgs.append(self._outbox.get_nowait())
            await self._send_batch(msgs)

    async def _send_batch(self, msgs: list[BaseTokenizerMsg]) -> None:
        """Send `msgs` together; if that fails, each alone, so that one message that cannot be sent
        (e.g. text that is not valid Unicode) fails only its own request and no abort is lost."""
        try:
            await self._send(msgs[0] if len(msgs) == 1 else BatchTokenizerMsg(data=msgs))
            return
        except Exception as e:
            if len(msgs) > 1:
                for m in msgs:
                    await self._send_batch([m])
                return
            self._send_failed(msgs[0], e)

    def _send_failed(self, msg: BaseTokenizerMsg, error: Exception) -> None:
        """The request of an unsendable message waits for nothing: end it with an error."""
        logger.error("cannot send a %s to the tokenizer: %s", type(msg).__name__, error)
        if not isinstance(msg, TokenizeMsg):
            return
        for uid in range(msg.uid, msg.uid + msg.n):
            stream = self.streams.get(uid)
            if stream is not None:
                stream.push(UserReply(uid, "", True, "error", error=f"cannot send the request: {error}"))

    async def listen(self, recv: Callable[[], Awaitable[BaseFrontendMsg]]) -> None:
        while True:
            try:
                msg = await recv()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a malformed message: log it and go on
                logger.warning("dropped a malformed message from the workers: %s", e)
                continue
            self.dispatch(msg)

    def dispatch(self, msg: BaseFrontendMsg) -> None:
        if isinstance(msg, BatchFrontendMsg):
            for m in msg.data:
                self.dispatch(m)
            return
        if isinstance(msg, LoadReply):
            if not self.router.on_report(msg):
                logger.warning("dropped a load report of replica %d, which does not exist", msg.replica)
            return
        if not isinstance(msg, UserReply):
            logger.warning("dropped an unexpected %s from the workers", type(msg).__name__)
            return
        stream = self.streams.get(msg.uid)
        if stream is not None:  # else finished or aborted already: a late reply
            stream.push(msg)


def _end(stream: RequestStream, reason: str) -> None:
    """Give `stream` a last reply from here: it ends with `reason` after the text it has."""
    stream.push(
        UserReply(
            uid=stream.uid,
            incremental_output="",
            finished=True,
            finish_reason=reason,
            completion_tokens=stream.completion_tokens,
        )
    )

"""The API server's side of the pipes: request ids, outgoing messages, and routing of replies.

One asyncio task (`listen`) pulls `UserReply` messages and appends each to the `RequestStream` of
its uid; one task (`_send_loop`) pushes `TokenizeMsg`/`AbortMsg` to the tokenizer(s), batching what
queued up meanwhile. Everything an HTTP handler does is therefore synchronous (`open`, `close`) or
an await on its own stream, so a handler cancelled by a disconnect can always clean up.
Each request is a `RequestStream` (`stream.py`); `ReplicaRouter` picks the data-parallel replica of
new requests.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from minisgl.core import SamplingParams
from minisgl.frontend.errors import Overloaded, RequestError
from minisgl.frontend.metrics import ServerMetrics
from minisgl.frontend.router import ReplicaRouter
from minisgl.frontend.stream import RequestStream
from minisgl.message import (
    AbortMsg,
    BaseFrontendMsg,
    BaseTokenizerMsg,
    BatchFrontendMsg,
    BatchTokenizerMsg,
    LoadReply,
    TokenizeMsg,
    UserReply,
)

logger = logging.getLogger("minisgl.server")

# A prompt as the tokenizer takes it: text, token ids, or chat messages (it applies the template).
TokenizerPrompt = str | list[int] | list[dict[str, str]]


@dataclass(frozen=True)
class PromptOptions:
    """How the tokenizer renders a prompt (chat) and whether the answer echoes it (completions)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    tools: str = ""  # JSON list of the tools the chat template renders ("" for none)
    include_stop_str: bool = False  # a matched stop string stays at the end of the text
    chat_template: str = ""  # the request's own chat template ("": the model's)
    template_kwargs: str = ""  # JSON object of more template variables ("" for none)


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
        streams = [
            RequestStream(self, first + i, stops, replica, opts.echo, opts.include_stop_str) for i in range(n)
        ]
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
        msg.chat_template = opts.chat_template
        msg.template_kwargs = opts.template_kwargs
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

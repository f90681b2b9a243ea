"""HTTP connection limits: read timeouts, a cap on open connections, and accept errors logged once
per interval.

uvicorn bounds only the idle time between two requests of a keep-alive connection (5 s, reset by
every byte received), so a client that trickles its headers or its body a byte every few seconds
held its connection, and a descriptor, forever. `guarded_h11` is uvicorn's h11 protocol with:
  - read deadlines: a connection must send a request's headers within --read-timeout seconds of
    connecting (or of the first byte of its next request on a keep-alive connection), and the body
    within as many again once the headers are in; past a deadline it is closed (the handler of a
    request whose body was cut sees a disconnect). Waiting for the answer (a long stream) is no read.
  - --max-connections: a connection opened while that many are open (idle keep-alive ones count)
    gets 503 in OpenAI's error shape for its request and is closed; GET /health is still answered.
    uvicorn's own `limit_concurrency` answers plain text and counts the new connection itself.
Out of descriptors, asyncio's accept loop logs a traceback for each of up to 2048 attempts per
event-loop turn (167,834 in 20 s were seen); `log_accept_errors` makes that one line per interval.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger("minisgl.server")

_RESERVED_FDS = 64  # descriptors the launcher keeps for itself (pipes, ZMQ sockets, logs)
_REPORT_INTERVAL_S = 10.0
_ACCEPT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def default_max_connections() -> int:
    """The soft open-file limit less what the launcher needs itself; 0 (no cap) when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 0
    return max(1, soft - _RESERVED_FDS)


class EveryInterval:
    """Logs a recurring event at most once per `interval_s`, saying how often it happened."""

    def __init__(self, level: int = logging.WARNING, interval_s: float = _REPORT_INTERVAL_S) -> None:
        self.level, self.interval_s = level, interval_s
        self.count = 0  # events since the last line
        self.total = 0
        self._last = -float("inf")

    def event(self, message: str, now: float | None = None) -> None:
        self.count += 1
        self.total += 1
        now = time.monotonic() if now is None else now
        if now - self._last >= self.interval_s:
            times = "once" if self.count == 1 else f"{self.count} times"
            logger.log(self.level, "%s (%s since the last report)", message, times)
            self.count, self._last = 0, now


def log_accept_errors(loop: asyncio.AbstractEventLoop) -> EveryInterval:
    """Route the loop's "socket.accept() out of system resource" reports through an EveryInterval;
    every other report goes where it went before."""
    previous = loop.get_exception_handler()
    report = EveryInterval()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if (
            isinstance(exc, OSError)
            and exc.errno in _ACCEPT_ERRNOS
            and "accept" in context.get("message", "")
        ):
            report.event(
                f"cannot accept HTTP connections: {exc.strerror}; raise the open-file limit (ulimit -n) "
                "or lower --max-connections"
            )
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    return report


def _over_limit(app: ASGIApp, limit: int) -> ASGIApp:
    """The app of a connection opened past --max-connections: 503 and close (but /health answers)."""
    from minisgl.entrypoints.openai.errors import error_response

    async def busy(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/health":
            await app(scope, receive, send)
            return
        message = f"the server has {limit} connections open, the most it takes (--max-connections)"
        response = error_response(503, message, "service_unavailable_error")
        response.headers["connection"] = "close"
        await response(scope, receive, send)

    return busy


# The part of a request a connection is sending, by h11's state of the client's side.
_READING = {h11.IDLE: "headers", h11.SEND_BODY: "body"}


def guarded_h11(max_connections: int, read_timeout: float, closed: EveryInterval) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with read deadlines and a connection cap (0: none); `closed` counts
    the connections closed for being slow."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _reading: str | None = None
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if max_connections and len(self.connections) > max_connections:
                self.app = _over_limit(self.app, max_connections)
            self._track_reading()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track_reading()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_deadline()
            super().connection_lost(exc)

        def _track_reading(self) -> None:
            """A new deadline whenever the connection starts sending headers or a body."""
            reading = _READING.get(self.conn.their_state)
            if reading == self._reading:
                return
            self._cancel_deadline()
            self._reading = reading
            if reading is not None and not self.transport.is_closing():
                self._deadline = self.loop.call_later(read_timeout, self._too_slow, reading)

        def _cancel_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self, reading: str) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                closed.event(
                    f"closed an HTTP connection that did not send its {reading} within --read-timeout"
                )
                self.transport.close()

    return GuardedH11Protocol

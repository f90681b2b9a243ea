"""ZMQ queues: thin layers over "message codec + socket" (the chapter's five kinds, plus XPUB waiting).

Every queue is built `(addr, create, encoder|decoder)`: the side with create=True binds, the other
connects. Given a group's chapter-style `BaseXMsg.encoder` / `BaseXMsg.decoder` (or the group base
class itself), a queue uses that group's one-step `to_bytes`/`from_bytes`; any other function is
used the chapter's way (`msgpack.packb(encoder(obj))`, `decoder(msgpack.unpackb(raw))`).

Malformed input policy: a receiving queue's `get()` raises `MessageDecodeError` for bytes that are
not a valid message; the bytes are consumed, so the caller logs, drops and calls `get()` again (the
next message is unaffected). `get_raw()` never decodes; `decode(raw)` raises the same error.

`stop()` closes with linger 0 (pending outgoing messages are dropped, never waited for) and never
hangs. ipc:// paths are checked against the platform's sun_path limit before ZMQ sees them.

Sends and a missing peer: a PUSH blocks while no peer can take a message (none connected, or its
pipe full), so a process whose peer died would hang in `put` and never read its own exit message.
A sender built with `send_timeout_s` waits at most that long, and not at all once `interrupt()` was
called (the process is stopping); what it then drops is logged once, not per message: one line when
it starts dropping, one (with the count) when a message gets through again. Without a timeout
(the default, the chapters' semantics) `put` blocks as ZMQ does.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar, cast

import msgpack
import zmq
import zmq.asyncio

from minisgl.message import MessageDecodeError
from minisgl.message.codec import group_of

T = TypeVar("T")
S = TypeVar("S", bound=zmq.Socket)  # a queue's socket: zmq's, or zmq.asyncio's
Q = TypeVar("Q", bound="_ZmqQueue")

logger = logging.getLogger("minisgl.utils.mp")

# How long a server process's send waits for a peer before it drops the message. A live peer takes
# a message within milliseconds (its receive buffer holds a thousand); only a dead one makes a send wait.
PEER_SEND_TIMEOUT_S = 5.0
_POLL_SLICE_S = 0.05  # a timed send re-checks `interrupt()` this often while it waits

# sockaddr_un.sun_path: 108 bytes on Linux, 104 on macOS/BSD, one of them the terminating NUL.
IPC_PATH_MAX = 103 if sys.platform == "darwin" or "bsd" in sys.platform else 107


def check_addr(addr: str) -> str:
    """Raise ValueError for an ipc:// path too long for a Unix socket (ZMQ's own error is obscure)."""
    if not isinstance(addr, str) or "://" not in addr:
        raise ValueError(f"a ZMQ address looks like 'ipc:///tmp/x' or 'tcp://host:port', got {addr!r}")
    if addr.startswith("ipc://"):
        path = addr[len("ipc://") :]
        size = len(path.encode())
        if size > IPC_PATH_MAX:
            raise ValueError(
                f"ipc path is {size} bytes, longer than the {IPC_PATH_MAX} a Unix socket path may have on "
                f"{sys.platform}: {path!r}; use a shorter directory (e.g. under /tmp)"
            )
        if size == 0:
            raise ValueError("empty ipc path")
    return addr


def _packer(encoder: Callable[[T], dict]) -> Callable[[T], bytes]:
    group = group_of(encoder)
    if group is not None:  # then T is that group's base: its messages are what `encoder` takes
        return cast(Callable[[T], bytes], group.to_bytes)
    return lambda obj: msgpack.packb(encoder(obj), use_bin_type=True)


def _unpacker(decoder: Callable[[dict], T]) -> Callable[[bytes], T]:
    group = group_of(decoder)
    if group is not None:  # then T is that group's base: its messages are what `decoder` makes
        return cast(Callable[[bytes], T], group.from_bytes)

    def decode(raw: bytes) -> T:
        try:
            data = msgpack.unpackb(raw, raw=False)
        except Exception as e:
            raise MessageDecodeError(f"not valid msgpack ({type(e).__name__}: {e})") from None
        return decoder(data)

    return decode


class _ZmqQueue(Generic[S]):
    """A socket with its own context; `stop()` closes both without waiting."""

    def __init__(self, addr: str, create: bool, kind: int, context: zmq.Context[S]) -> None:
        check_addr(addr)
        self.addr = addr
        self.context = context
        self.socket: S = context.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.bind(addr) if create else self.socket.connect(addr)
        except zmq.ZMQError as e:
            self.stop()
            raise OSError(f"cannot {'bind' if create else 'connect'} {addr}: {e}") from e
        self._stopped = False

    def stop(self, linger_ms: int = 0) -> None:
        """Close the socket and its context. Idempotent. By default (linger 0) it never blocks and
        drops what is still unsent; a one-shot sender that must deliver passes a bounded linger."""
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        self.socket.close(linger=linger_ms)
        self.context.term()

    def __enter__(self: Q) -> Q:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Receiver(_ZmqQueue[zmq.Socket[bytes]], Generic[T]):
    def __init__(self, addr: str, create: bool, kind: int, decoder: Callable[[dict], T]) -> None:
        super().__init__(addr, create, kind, zmq.Context())
        self._decode = _unpacker(decoder)

    def get(self) -> T:
        """Block for the next message; MessageDecodeError if its bytes are not one (they are consumed)."""
        return self._decode(self.socket.recv())

    def get_raw(self) -> bytes:
        """Block for the next message's bytes, undecoded."""
        return self.socket.recv()

    def decode(self, raw: bytes) -> T:
        return self._decode(raw)

    def empty(self) -> bool:
        """True if no message is waiting right now (never blocks)."""
        return self.socket.poll(0, zmq.POLLIN) == 0

    def poll(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for a message; True if one is waiting."""
        return self.socket.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN) != 0


class _SendGate:
    """The timeout policy of one sending socket: how long a send may wait, and the drop log.

    After a send timed out, later sends do not wait at all until one gets through again (a dead peer
    must not cost the timeout on every message)."""

    def __init__(self, addr: str, send_timeout_s: float | None) -> None:
        if send_timeout_s is not None and send_timeout_s < 0:
            raise ValueError(f"send_timeout_s must be >= 0 or None, got {send_timeout_s}")
        self.addr = addr
        self.timeout_s = send_timeout_s
        self.interrupted = threading.Event()
        self.dropped = 0  # messages dropped since the last one that got through
        self.total_dropped = 0

    def wait_s(self) -> float:
        """How long the next send may wait for a peer."""
        if self.interrupted.is_set() or self.dropped or self.timeout_s is None:
            return 0.0
        return self.timeout_s

    def on_sent(self) -> None:
        if self.dropped:
            logger.warning("%s: a peer takes messages again; %d were dropped", self.addr, self.dropped)
            self.dropped = 0

    def on_dropped(self) -> None:
        if not self.dropped:
            why = "stopping" if self.interrupted.is_set() else f"no peer took it within {self.timeout_s:g} s"
            logger.warning("%s: dropping messages (%s)", self.addr, why)
        self.dropped += 1
        self.total_dropped += 1


class _Sender(_ZmqQueue[zmq.Socket[bytes]], Generic[T]):
    def __init__(
        self,
        addr: str,
        create: bool,
        kind: int,
        encoder: Callable[[T], dict],
        send_timeout_s: float | None = None,
    ) -> None:
        self._gate = _SendGate(addr, send_timeout_s)
        super().__init__(addr, create, kind, zmq.Context())
        self._encode = _packer(encoder)

    @property
    def total_dropped(self) -> int:
        """Messages this queue dropped for want of a peer (only with a send timeout)."""
        return self._gate.total_dropped

    def interrupt(self) -> None:
        """From now on never wait for a peer (safe from another thread; the process is stopping)."""
        self._gate.interrupted.set()

    def put(self, obj: T) -> bool:
        """Send; False if it was dropped (only with a send timeout: no peer took it in time)."""
        return self._send(self._encode(obj))

    def put_raw(self, raw: bytes) -> bool:
        """Send bytes as they are (e.g. forwarding what another queue's `get_raw` returned)."""
        return self._send(raw)

    def _send(self, raw: bytes) -> bool:
        if self._gate.timeout_s is None:
            self.socket.send(raw, copy=False)
            return True
        deadline = time.monotonic() + self._gate.wait_s()
        while True:
            try:
                self.socket.send(raw, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                left = min(deadline - time.monotonic(), self._gate.wait_s())
                if left <= 0:
                    self._gate.on_dropped()
                    return False
                self.socket.poll(int(min(left, _POLL_SLICE_S) * 1000) + 1, zmq.POLLOUT)
                continue
            self._gate.on_sent()
            return True


class ZmqPushQueue(_Sender[T]):
    """One end of a pipe: messages arrive in order. Without a send timeout none is dropped (send
    blocks at the high-water mark); with one, see the module docstring."""

    def __init__(
        self, addr: str, create: bool, encoder: Callable[[T], dict], send_timeout_s: float | None = None
    ) -> None:
        super().__init__(addr, create, zmq.PUSH, encoder, send_timeout_s)


class ZmqPullQueue(_Receiver[T]):
    """The other end of a pipe (several pushers may feed one puller)."""

    def __init__(self, addr: str, create: bool, decoder: Callable[[dict], T]) -> None:
        super().__init__(addr, create, zmq.PULL, decoder)


class ZmqPubQueue(_Sender[T]):
    """The broadcast queue. XPUB rather than PUB: XPUB hears each subscription, so the publisher can
    wait for all subscribers before its first message (the "slow joiner": anything published before a
    subscription takes effect is silently dropped for that subscriber)."""

    def __init__(self, addr: str, create: bool, encoder: Callable[[T], dict]) -> None:
        super().__init__(addr, create, zmq.XPUB, encoder)
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # one notification per subscriber, no dedup
        self.subscribers = 0

    def wait_for_subscribers(self, n: int, timeout: float | None = 60.0) -> None:
        """Return once n subscriptions have arrived in total; TimeoutError after `timeout` seconds
        (None: wait forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.subscribers < n:
            wait_ms = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self.socket.poll(wait_ms, zmq.POLLIN):
                raise TimeoutError(
                    f"{self.addr}: {self.subscribers} of {n} subscriber(s) after {timeout:.1f}s "
                    "(did every rank start?)"
                )
            event = self.socket.recv()
            if event[:1] == b"\x01":  # subscribe (b"\x00" is an unsubscribe)
                self.subscribers += 1
            elif event[:1] == b"\x00":
                self.subscribers -= 1


class ZmqSubQueue(_Receiver[T]):
    """A subscriber to everything a ZmqPubQueue publishes."""

    def __init__(self, addr: str, create: bool, decoder: Callable[[dict], T]) -> None:
        super().__init__(addr, create, zmq.SUB, decoder)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")


class ZmqAsyncPushQueue(_ZmqQueue[zmq.asyncio.Socket], Generic[T]):
    """PUSH for an asyncio event loop (the API server): `await put(obj)` never blocks the loop.

    With `send_timeout_s`, a put that no peer takes in time raises TimeoutError (the caller has
    requests to answer); the message is not sent."""

    def __init__(
        self, addr: str, create: bool, encoder: Callable[[T], dict], send_timeout_s: float | None = None
    ) -> None:
        if send_timeout_s is not None and send_timeout_s < 0:
            raise ValueError(f"send_timeout_s must be >= 0 or None, got {send_timeout_s}")
        super().__init__(addr, create, zmq.PUSH, zmq.asyncio.Context())
        self._encode = _packer(encoder)
        self.send_timeout_s = send_timeout_s

    async def put(self, obj: T) -> None:
        await self.put_raw(self._encode(obj))

    async def put_raw(self, raw: bytes) -> None:
        if self.send_timeout_s is None:
            await self.socket.send(raw, copy=False)
            return
        try:
            await asyncio.wait_for(self.socket.send(raw, copy=False), self.send_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"{self.addr}: no peer took the message within {self.send_timeout_s:g} s"
            ) from None


class ZmqAsyncPullQueue(_ZmqQueue[zmq.asyncio.Socket], Generic[T]):
    """PULL for an asyncio event loop; `await get()` (MessageDecodeError for malformed bytes)."""

    def __init__(self, addr: str, create: bool, decoder: Callable[[dict], T]) -> None:
        super().__init__(addr, create, zmq.PULL, zmq.asyncio.Context())
        self._decode = _unpacker(decoder)

    async def get(self) -> T:
        return self._decode(await self.socket.recv())

    async def get_raw(self) -> bytes:
        return await self.socket.recv()

    def decode(self, raw: bytes) -> T:
        return self._decode(raw)

    def empty(self) -> bool:
        """True if no message is waiting right now (never blocks, no await needed)."""
        return not int(self.socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN

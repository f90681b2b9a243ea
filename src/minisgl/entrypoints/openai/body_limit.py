"""The request-body limit: a body over `max_request_bytes` gets 413 before it is read."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.entrypoints.openai.errors import error_response


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 without being read further
    (at once when its Content-Length says so). The body read is handed on to the app unchanged."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                await self.app(scope, _replay(message, receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay(body, receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"the request body is larger than {self.limit} bytes, the most this server accepts "
            "(--max-request-bytes)"
        )
        await error_response(413, message, "invalid_request_error")(scope, receive, send)


def _replay(first: Message, receive: Receive) -> Receive:
    """A `receive` that gives `first` once, then reads on from the real one."""
    pending = [first]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay

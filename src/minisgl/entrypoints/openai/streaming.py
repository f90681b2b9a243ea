"""The streamed bodies: OpenAI's SSE chunks (`data: {...}`, ending in `data: [DONE]`), error events,
the Responses API's named events, and the streaming response that aborts its requests when the
client leaves."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from minisgl.entrypoints.openai.protocol import SamplingRequest
from minisgl.entrypoints.openai.serving import JSONObject, merged_chunks, request_usage
from minisgl.frontend.chunk import Chunk
from minisgl.frontend.errors import RequestError
from minisgl.frontend.stream import RequestStream


class StreamResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close`, even when the client is gone before the
    body starts (then the body generator never runs, so its own `finally` cannot be relied on)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(obj: JSONObject) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def error_event(e: Exception) -> bytes:
    """An SSE error event: a client's mistake keeps its 4xx code and type, as without streaming."""
    if not isinstance(e, RequestError):
        e = RequestError(str(e), 500)
    return sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.status}})


@dataclass
class _ChunkEvents:
    """The SSE body of a streamed OpenAI completion: chunks that share id, object, time and model;
    with `include_usage` each carries "usage" (null until the last, choice-less one)."""

    rid: str
    object: str
    model: str
    include_usage: bool
    continuous_usage: bool = False  # usage (that choice's so far) in every chunk
    created: int = field(default_factory=lambda: int(time.time()))

    def event(
        self, choices: list[JSONObject], usage: JSONObject | None = None, more: JSONObject | None = None
    ) -> bytes:
        obj: JSONObject = {
            "id": self.rid,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **(more or {}),
        }
        if self.include_usage:
            obj["usage"] = usage
        return sse(obj)

    async def body(
        self,
        streams: list[RequestStream],
        n: int,
        choice: Callable[[int, Chunk], JSONObject],
        head: list[JSONObject] | None = None,
        head_more: JSONObject | None = None,
    ) -> AsyncIterator[bytes]:
        """The `head` choices (one event each, the first with `head_more`'s fields), then one event
        per chunk as it comes (an error ends them), the usage once every choice finished, and [DONE]."""
        for i, c in enumerate(head or []):
            yield self.event(
                [c], self._running_usage(streams[i].prompt_tokens, 0), head_more if i == 0 else None
            )
        async for i, item in merged_chunks(streams):
            if isinstance(item, Exception):
                yield error_event(item)
                break
            yield self.event(
                [choice(i, item)], self._running_usage(item.prompt_tokens, item.completion_tokens)
            )
            if item.error is not None:  # the choice could not go on: why, after its last chunk
                yield error_event(item.error)
        if self.include_usage:
            yield self.event([], request_usage(streams, n))
        yield DONE

    def _running_usage(self, prompt: int, completion: int) -> JSONObject | None:
        if not self.continuous_usage:
            return None
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chunk_events(body: SamplingRequest, rid: str, obj: str, name: str) -> _ChunkEvents:
    return _ChunkEvents(rid, obj, name, body.include_usage, body.continuous_usage)


def named_sse(event: JSONObject) -> bytes:
    """An event of the Responses API: its type also on an `event:` line, and no [DONE] after."""
    return f"event: {event['type']}\n".encode() + sse(event)

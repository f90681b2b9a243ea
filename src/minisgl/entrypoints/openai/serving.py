"""What every endpoint does with its requests: open the streams of a request's `n` choices (times its
prompts) and wait for the tokenizer's verdict, bounded and no longer than the client stays; collect
the choices of a non-streaming request; the usage. A client that disconnects has its unfinished
requests aborted (a waiting handler polls `request.is_disconnected()`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from minisgl.core import SamplingParams
from minisgl.entrypoints.openai.errors import APIError
from minisgl.entrypoints.openai.state import ServerState
from minisgl.frontend.chunk import Chunk
from minisgl.frontend.errors import Overloaded, RequestError
from minisgl.frontend.manager import FrontendManager, PromptOptions, TokenizerPrompt
from minisgl.frontend.stream import RequestStream

_DISCONNECT_POLL_S = 0.25


T = TypeVar("T")


JSONObject = dict[str, Any]


async def open_all(
    state: ServerState,
    request: Request,
    prompts: list[TokenizerPrompt],
    params: SamplingParams,
    stops: list[str],
    n: int,
    options: PromptOptions | None = None,
    grammar_field: str | None = None,
    stream: bool = False,
) -> list[RequestStream]:
    """`n` streams per prompt; waits (bounded, and no longer than the client stays) until the
    tokenizer accepted all of them. With a grammar (from the request's `grammar_field`) a streamed
    request also waits for its first output, so that a grammar the scheduler refuses is a plain 400."""
    manager = state.manager
    streams: list[RequestStream] = []
    try:
        manager.check_room(len(prompts) * n)
        for prompt in prompts:
            streams += manager.open(prompt, params, stops, n, options)
        for s in streams:
            s.grammar_field = grammar_field
        accepted = asyncio.gather(*(s.accepted() for s in streams))
        await _until_disconnect(request, asyncio.wait_for(accepted, state.tokenize_timeout))
        if stream and params.grammar is not None:
            await _until_disconnect(request, asyncio.gather(*(s.started() for s in streams)))
    except Overloaded as e:
        release_all(manager, streams)
        raise APIError(503, f"the server is busy: {e}", "service_unavailable_error") from None
    except RequestError as e:
        release_all(manager, streams)
        raise APIError(e.status, e.message, e.type, e.param) from None
    except asyncio.TimeoutError:
        release_all(manager, streams)
        raise APIError(
            503,
            f"the tokenizer did not answer within {state.tokenize_timeout:g} s",
            "service_unavailable_error",
        ) from None
    except BaseException:
        release_all(manager, streams)
        raise
    return streams


def release_all(manager: FrontendManager, streams: list[RequestStream]) -> None:
    for s in streams:
        manager.release(s)


async def merged_chunks(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Chunk | Exception]]:
    """(choice index, chunk) from all streams as they come; an Exception ends that choice."""
    if len(streams) == 1:
        try:
            async for chunk in streams[0].chunks():
                yield 0, chunk
        except RequestError as e:
            yield 0, e
        return
    queue: asyncio.Queue[tuple[int, Chunk | Exception | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for chunk in s.chunks():
                queue.put_nowait((i, chunk))
        except RequestError as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


@dataclass
class Choice:
    """One choice of a non-streaming answer, its chunks put together."""

    text: str = ""
    finish_reason: str = "abort"
    stop_reason: str | int | None = None
    chunks: list[Chunk] = field(default_factory=list)

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.chunks.append(chunk)
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason


async def _collect(streams: list[RequestStream]) -> tuple[list[Choice], Exception | None]:
    choices = [Choice() for _ in streams]
    async for i, item in merged_chunks(streams):
        if isinstance(item, Exception):
            return choices, item
        choices[i].add(item)
    return choices, None


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; cancel it (its streams get aborted) if the client disconnects meanwhile."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected", "client_closed_request")
    finally:
        if not task.done():
            task.cancel()


async def finish_all(
    request: Request, manager: FrontendManager, streams: list[RequestStream]
) -> list[Choice]:
    """Wait for every choice of a non-streaming request (aborting them if the client leaves)."""
    try:
        choices, err = await _until_disconnect(request, _collect(streams))
    finally:
        release_all(manager, streams)
    if err is not None:  # a request the scheduler refused before any token: the client's (400)
        if isinstance(err, RequestError):
            raise APIError(err.status, err.message, err.type, err.param)
        raise APIError(500, str(err), "server_error")
    return choices


def request_usage(streams: list[RequestStream], n: int) -> JSONObject:
    prompt = sum(s.prompt_tokens for s in streams[::n])  # each prompt counted once, not per choice
    cached = sum(s.cached_tokens for s in streams[::n])
    completion = sum(s.completion_tokens for s in streams)
    usage: JSONObject = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if any(s.reasoning for s in streams):  # a reasoning model's chat answer
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(s.reasoning_tokens for s in streams)}
    return usage


def completion_response(
    rid: str,
    obj: str,
    model: str,
    choices: list[JSONObject],
    usage: JSONObject,
    more: JSONObject | None = None,
) -> JSONResponse:
    """The non-streaming body shared by chat completions and completions (`more`: fields after
    OpenAI's, e.g. vLLM's prompt_token_ids)."""
    return JSONResponse(
        {
            "id": rid,
            "object": obj,
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage,
            **(more or {}),
        }
    )

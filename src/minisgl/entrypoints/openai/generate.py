"""`POST /generate`: the chapters' native endpoint, streamed text events or one JSON object."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from minisgl.entrypoints.openai.protocol import GenerateRequest
from minisgl.entrypoints.openai.serving import finish_all, open_all
from minisgl.entrypoints.openai.state import State, check_ready
from minisgl.entrypoints.openai.streaming import DONE, StreamResponse, error_event, sse
from minisgl.frontend.errors import RequestError
from minisgl.frontend.stream import RequestStream

router = APIRouter()


async def _generate_events(stream: RequestStream) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream.chunks():
            yield sse({"text": chunk.text, "finish_reason": chunk.finish_reason})
    except RequestError as e:
        yield error_event(e)
    yield DONE


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request, state: State) -> Response:
    """The chapters' native endpoint. Streams `data: {"text": ..., "finish_reason": ...}` events
    then `data: [DONE]`; with "stream": false answers one JSON object."""
    check_ready(state, None)
    params = body.sampling_params()
    streams = await open_all(
        state, request, [body.prompt], params, body.stop_list, 1, None, body.grammar_field, body.stream
    )
    [stream] = streams
    if body.stream:
        return StreamResponse(_generate_events(stream), lambda: state.manager.release(stream))
    [done] = await finish_all(request, state.manager, streams)
    return JSONResponse(
        {
            "text": done.text,
            "finish_reason": done.finish_reason,
            "prompt_tokens": stream.prompt_tokens,
            "completion_tokens": stream.completion_tokens,
            "cached_tokens": stream.cached_tokens,
        }
    )

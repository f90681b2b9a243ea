"""`POST /v1/responses`: OpenAI's Responses API on the chat path (`responses_request.py` maps the
request onto a chat request, `responses_output.py` builds the answer and its events)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from minisgl.entrypoints.openai.chat import open_chat, tool_outputs
from minisgl.entrypoints.openai.responses.output import ResponseBuilder, response_usage
from minisgl.entrypoints.openai.responses.request import ResponsesRequest
from minisgl.entrypoints.openai.serving import JSONObject, finish_all
from minisgl.entrypoints.openai.state import State, check_ready
from minisgl.entrypoints.openai.streaming import StreamResponse, named_sse
from minisgl.frontend.errors import RequestError
from minisgl.frontend.stream import RequestStream

router = APIRouter()


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, state: State) -> Response:
    """OpenAI's Responses API, on the chat path (see responses_request.py, responses_output.py)."""
    check_ready(state, body.model)
    chat = body.chat
    [stream] = await open_chat(state, request, chat, body.grammar_field)
    name = body.model or state.model_name
    tools = tool_outputs(state, chat, 1)
    builder = ResponseBuilder(name, body.echo(), tools[0] if tools else None, body.logprobs)
    if body.stream:
        return StreamResponse(_response_events(builder, stream), lambda: state.manager.release(stream))
    [done] = await finish_all(request, state.manager, [stream])
    for chunk in done.chunks:
        builder.feed(chunk)
    builder.complete(_response_usage(stream))
    return JSONResponse(builder.response())


def _response_usage(stream: RequestStream) -> JSONObject:
    return response_usage(stream.prompt_tokens, stream.completion_tokens, stream.cached_tokens)


async def _response_events(builder: ResponseBuilder, stream: RequestStream) -> AsyncIterator[bytes]:
    for event in builder.start():
        yield named_sse(event)
    try:
        async for chunk in stream.chunks():
            for event in builder.feed(chunk):
                yield named_sse(event)
    except RequestError as e:
        yield named_sse(builder.error(e))
        return
    for event in builder.complete(_response_usage(stream)):
        yield named_sse(event)

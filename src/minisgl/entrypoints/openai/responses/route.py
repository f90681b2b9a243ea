"""`POST /v1/responses`: OpenAI's Responses API on the chat path (`request.py` maps the request onto
a chat request, `output.py` builds the answer and its events), and `GET` / `DELETE
/v1/responses/{id}` of the responses kept in memory (`store.py`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from minisgl.entrypoints.openai.chat import open_chat, tool_outputs
from minisgl.entrypoints.openai.errors import APIError
from minisgl.entrypoints.openai.extensions.reasoning import ReasoningSplit
from minisgl.entrypoints.openai.responses.output import ResponseBuilder, response_usage
from minisgl.entrypoints.openai.responses.request import ResponsesRequest
from minisgl.entrypoints.openai.responses.store import output_items
from minisgl.entrypoints.openai.serving import JSONObject, finish_all
from minisgl.entrypoints.openai.state import ServerState, State, check_ready
from minisgl.entrypoints.openai.streaming import StreamResponse, named_sse
from minisgl.frontend.errors import RequestError
from minisgl.frontend.stream import RequestStream

router = APIRouter()


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, state: State) -> Response:
    """OpenAI's Responses API, on the chat path (see request.py, output.py); the response is kept
    unless the request says store: false."""
    check_ready(state, body.model)
    history = _history(state, body)
    chat = body.chat
    [stream] = await open_chat(state, request, chat, body.grammar_field)
    name = body.model or state.model_name
    tools = tool_outputs(state, chat, 1)
    split = ReasoningSplit() if chat.separate_reasoning else None
    builder = ResponseBuilder(name, body.echo(), tools[0] if tools else None, body.logprobs, split)
    if body.stream:
        events = _response_events(state, body, history, builder, stream)
        return StreamResponse(events, lambda: state.manager.release(stream))
    [done] = await finish_all(request, state.manager, [stream])
    for chunk in done.chunks:
        builder.feed(chunk)
    builder.complete(_response_usage(stream))
    _keep(state, body, history, builder)
    return JSONResponse(builder.response())


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, state: State) -> JSONObject:
    kept = state.responses.get(response_id)
    if kept is None:
        raise _not_found(state, response_id, "response_id")
    return kept.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: State) -> JSONObject:
    if not state.responses.delete(response_id):
        raise _not_found(state, response_id, "response_id")
    return {"id": response_id, "object": "response", "deleted": True}


def _not_found(state: ServerState, response_id: str, param: str, status: int = 404) -> APIError:
    return APIError(
        status,
        f"Response with id '{response_id[:256]}' not found (responses are kept in this server's memory, "
        f"the latest {state.responses.max_responses} at most)",
        "invalid_request_error",
        param,
        "previous_response_not_found" if param == "previous_response_id" else None,
    )


def _history(state: ServerState, body: ResponsesRequest) -> list[JSONObject]:
    """The conversation `previous_response_id` continues ([] if none), its chat request made."""
    if body.previous_response_id is None:
        return []
    kept = state.responses.get(body.previous_response_id)
    if kept is None:
        # a 400, as OpenAI answers a request that names an unknown response (a GET of one is a 404)
        raise _not_found(state, body.previous_response_id, "previous_response_id", 400)
    try:
        body.chat_after(kept.items)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_request_error") from None
    return kept.items


def _keep(
    state: ServerState, body: ResponsesRequest, history: list[JSONObject], builder: ResponseBuilder
) -> None:
    if body.stores and builder.status != "failed":
        items = history + body.input_items() + output_items(builder.output)
        state.responses.put(builder.response(), items)


def _response_usage(stream: RequestStream) -> JSONObject:
    return response_usage(
        stream.prompt_tokens, stream.completion_tokens, stream.cached_tokens, stream.reasoning_tokens
    )


async def _response_events(
    state: ServerState,
    body: ResponsesRequest,
    history: list[JSONObject],
    builder: ResponseBuilder,
    stream: RequestStream,
) -> AsyncIterator[bytes]:
    for event in builder.start():
        yield named_sse(event)
    try:
        async for chunk in stream.chunks():
            for event in builder.feed(chunk):
                yield named_sse(event)
    except RequestError as e:
        yield named_sse(builder.error(e))
        return
    events = builder.complete(_response_usage(stream))
    _keep(state, body, history, builder)
    for event in events:
        yield named_sse(event)

"""The HTTP API: OpenAI-compatible chat and text completions, OpenAI's Responses API (a chat request
underneath), the native `/generate`, health, models and Prometheus metrics.

Each route is a module-level function on `router`. What the routes share lives in a `ServerState`
(health, model names, and the `FrontendManager` that talks to the workers) on `app.state.server`;
a route receives it through the `State` dependency, so a test can call a route with a state of its
own. `create_app(state)` builds the FastAPI app; the launcher runs it under uvicorn, the unit tests
run it against a fake backend. Every error, a client's or ours, is answered in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`; a client's mistake is never a 500.

A request with `n` choices (times the number of prompts) becomes that many scheduler requests, each
prompt tokenized once. A client that disconnects has all of its unfinished requests aborted:
streaming responses notice it through the ASGI server; a handler waiting for the tokenizer's verdict
or for a non-streaming result, by polling `request.is_disconnected()`. The wait for the tokenizer's
verdict is bounded (`ServerState.tokenize_timeout`), and a body over `max_request_bytes` gets 413
before it is read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.core import SamplingParams

from .frontend import (
    Chunk,
    FrontendManager,
    Overloaded,
    PromptOptions,
    RequestError,
    RequestStream,
    TokenizerPrompt,
)
from .logprobs_format import ChatLogprobs, CompletionLogprobs
from .protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, SamplingRequest
from .responses_output import ResponseBuilder, response_usage
from .responses_request import ResponsesRequest
from .tools import ToolFormat, ToolOutput

logger = logging.getLogger("minisgl.server")

_DISCONNECT_POLL_S = 0.25
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
DEFAULT_TOKENIZE_TIMEOUT_S = 60.0

T = TypeVar("T")
JSONObject = dict[str, Any]


@dataclass
class ServerState:
    """What the routes need besides the request; `status` drives /health."""

    manager: FrontendManager
    model_name: str
    model_aliases: set[str] = field(default_factory=set)
    max_seq_len: int = 0
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413; None: no cap
    tokenize_timeout: float = DEFAULT_TOKENIZE_TIMEOUT_S  # seconds to wait for the tokenizer's verdict
    tools: ToolFormat = field(default_factory=ToolFormat)  # how tools are rendered and parsed
    status: str = "starting"  # starting | serving | stopping | unhealthy
    detail: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def knows_model(self, name: str | None) -> bool:
        return name is None or name == self.model_name or name in self.model_aliases


async def server_state(request: Request) -> ServerState:
    """The app's `ServerState`, as a FastAPI dependency (async: FastAPI would run a plain function
    in its thread pool)."""
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]


# ---- errors ------------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error"}


def _printable(text: str) -> str:
    """`text` made encodable as UTF-8: a lone surrogate (from the client's JSON) becomes '\\udXXX'.
    An error message that echoes the client's input must not itself fail to be sent (a 500)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int,
    message: str,
    type_: str | None = None,
    param: str | None = None,
    code: str | int | None = None,
) -> JSONResponse:
    type_ = type_ or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {
        "error": {
            "message": _printable(message),
            "type": type_,
            "param": None if param is None else _printable(param),
            "code": _printable(code) if isinstance(code, str) else code if code is not None else status,
        }
    }
    return JSONResponse(body, status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(exc)
    return error_response(400, message, param=param)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = "no such route" if exc.status_code == 404 else str(exc.detail)
    return error_response(exc.status_code, message)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error: %s", exc)
    return error_response(500, f"internal server error: {type(exc).__name__}")


_EXCEPTION_HANDLERS: dict[int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]] = {
    RequestValidationError: _invalid_request,
    StarletteHTTPException: _http_error,
    APIError: _api_error,
    Exception: _internal_error,
}


# ---- request plumbing --------------------------------------------------------------------------


class _BodyLimit:
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


class _StreamResponse(StreamingResponse):
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


def _check_ready(state: ServerState, model: str | None) -> None:
    if state.status != "serving":
        raise APIError(503, f"the server is {state.status}", "service_unavailable_error")
    if not state.knows_model(model):
        raise APIError(
            404,
            f"the model '{model}' does not exist (this server serves '{state.model_name}')",
            "not_found_error",
            "model",
            "model_not_found",
        )


async def _open_all(
    state: ServerState,
    request: Request,
    prompts: list[TokenizerPrompt],
    params: SamplingParams,
    stops: list[str],
    n: int,
    options: PromptOptions | None = None,
) -> list[RequestStream]:
    """`n` streams per prompt; waits (bounded, and no longer than the client stays) until the
    tokenizer accepted all of them."""
    manager = state.manager
    streams: list[RequestStream] = []
    try:
        manager.check_room(len(prompts) * n)
        for prompt in prompts:
            streams += manager.open(prompt, params, stops, n, options)
        accepted = asyncio.gather(*(s.accepted() for s in streams))
        await _until_disconnect(request, asyncio.wait_for(accepted, state.tokenize_timeout))
    except Overloaded as e:
        _release_all(manager, streams)
        raise APIError(503, f"the server is busy: {e}", "service_unavailable_error") from None
    except RequestError as e:
        _release_all(manager, streams)
        raise APIError(e.status, e.message, "invalid_request_error") from None
    except asyncio.TimeoutError:
        _release_all(manager, streams)
        raise APIError(
            503,
            f"the tokenizer did not answer within {state.tokenize_timeout:g} s",
            "service_unavailable_error",
        ) from None
    except BaseException:
        _release_all(manager, streams)
        raise
    return streams


def _release_all(manager: FrontendManager, streams: list[RequestStream]) -> None:
    for s in streams:
        manager.release(s)


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Chunk | Exception]]:
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
class _Choice:
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


async def _collect(streams: list[RequestStream]) -> tuple[list[_Choice], Exception | None]:
    choices = [_Choice() for _ in streams]
    async for i, item in _merged(streams):
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


async def _finish_all(
    request: Request, manager: FrontendManager, streams: list[RequestStream]
) -> list[_Choice]:
    """Wait for every choice of a non-streaming request (aborting them if the client leaves)."""
    try:
        choices, err = await _until_disconnect(request, _collect(streams))
    finally:
        _release_all(manager, streams)
    if err is not None:  # a request the scheduler refused before any token: the client's (400)
        status = err.status if isinstance(err, RequestError) else 500
        raise APIError(status, str(err), "invalid_request_error" if status == 400 else "server_error")
    return choices


def _usage(streams: list[RequestStream], n: int) -> JSONObject:
    prompt = sum(s.prompt_tokens for s in streams[::n])  # each prompt counted once, not per choice
    cached = sum(s.cached_tokens for s in streams[::n])
    completion = sum(s.completion_tokens for s in streams)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# ---- response bodies ---------------------------------------------------------------------------


def _sse(obj: JSONObject) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _error_event(e: Exception) -> bytes:
    message = e.message if isinstance(e, RequestError) else str(e)
    return _sse({"error": {"message": message, "type": "server_error", "param": None, "code": 500}})


def _completion_response(
    rid: str, obj: str, model: str, choices: list[JSONObject], usage: JSONObject
) -> JSONResponse:
    """The non-streaming body shared by chat completions and completions."""
    return JSONResponse(
        {
            "id": rid,
            "object": obj,
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage,
        }
    )


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

    def event(self, choices: list[JSONObject], usage: JSONObject | None = None) -> bytes:
        obj: JSONObject = {
            "id": self.rid,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            obj["usage"] = usage
        return _sse(obj)

    async def body(
        self,
        streams: list[RequestStream],
        n: int,
        choice: Callable[[int, Chunk], JSONObject],
        head: list[JSONObject] | None = None,
    ) -> AsyncIterator[bytes]:
        """The `head` choices (one event each), then one event per chunk as it comes (an error
        ends them), the usage once every choice finished, and [DONE]."""
        for i, c in enumerate(head or []):
            yield self.event([c], self._running_usage(streams[i].prompt_tokens, 0))
        async for i, item in _merged(streams):
            if isinstance(item, Exception):
                yield _error_event(item)
                break
            yield self.event(
                [choice(i, item)], self._running_usage(item.prompt_tokens, item.completion_tokens)
            )
        if self.include_usage:
            yield self.event([], _usage(streams, n))
        yield _DONE

    def _running_usage(self, prompt: int, completion: int) -> JSONObject | None:
        if not self.continuous_usage:
            return None
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chat_role(i: int) -> JSONObject:
    """The first chunk of chat choice `i`: the assistant's role, no text yet."""
    return {
        "index": i,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


def _chat_delta(
    logprobs: list[ChatLogprobs] | None, tools: list[ToolOutput] | None, legacy: bool
) -> Callable[[int, Chunk], JSONObject]:
    def delta(i: int, chunk: Chunk) -> JSONObject:
        d: JSONObject = {"content": chunk.text} if chunk.text else {}
        finish = chunk.finish_reason
        if tools is not None:
            parts = tools[i].feed(chunk.text)
            if finish is not None:
                more, finish = tools[i].finish(finish)
                parts += more
            d, finish = _merged_delta(parts, legacy), _legacy_reason(finish, legacy)
        lp = logprobs[i].of(chunk.logprobs) if logprobs else None
        out = {"index": i, "delta": d, "logprobs": lp, "finish_reason": finish}
        if chunk.finish_reason is not None:
            out["stop_reason"] = chunk.stop_reason
        return out

    return delta


def _merged_delta(parts: list[JSONObject], legacy: bool) -> JSONObject:
    """Deltas of one chunk as one: content joined, tool call pieces of one index joined; with the
    legacy `functions`, the first call as `function_call`."""
    content = "".join(p.get("content", "") for p in parts)
    calls: dict[int, JSONObject] = {}
    for p in parts:
        for c in p.get("tool_calls", []):
            if c["index"] in calls:
                fn = calls[c["index"]]["function"]
                fn["arguments"] = fn.get("arguments", "") + c["function"].get("arguments", "")
            else:
                calls[c["index"]] = {**c, "function": dict(c["function"])}
    out: JSONObject = {"content": content} if content else {}
    if calls and legacy:
        if 0 in calls:
            out["function_call"] = calls[0]["function"]
    elif calls:
        out["tool_calls"] = list(calls.values())
    return out


def _legacy_reason(finish: str | None, legacy: bool) -> str | None:
    return "function_call" if legacy and finish == "tool_calls" else finish


def _chat_message(c: _Choice, tools: ToolOutput | None, legacy: bool) -> tuple[JSONObject, str]:
    """A non-streamed choice's message (content and tool calls) and finish reason."""
    if tools is None:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    tools.feed(c.text)
    _, finish = tools.finish(c.finish_reason)
    message: JSONObject = {"role": "assistant", "content": tools.content or None}
    if tools.calls and legacy:
        message["function_call"] = tools.calls[0].message()["function"]
    elif tools.calls:
        message["tool_calls"] = [call.message() for call in tools.calls]
    return message, _legacy_reason(finish, legacy) or finish


def _text_choice(logprobs: list[CompletionLogprobs] | None) -> Callable[[int, Chunk], JSONObject]:
    def choice(i: int, chunk: Chunk) -> JSONObject:
        lp = logprobs[i].of(chunk) if logprobs else None
        out = {"index": i, "text": chunk.text, "logprobs": lp, "finish_reason": chunk.finish_reason}
        if chunk.finish_reason is not None:
            out["stop_reason"] = chunk.stop_reason
        return out

    return choice


async def _generate_events(stream: RequestStream) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream.chunks():
            yield _sse({"text": chunk.text, "finish_reason": chunk.finish_reason})
    except RequestError as e:
        yield _error_event(e)
    yield _DONE


# ---- the routes --------------------------------------------------------------------------------

router = APIRouter()


@router.get("/health")
async def health(state: State) -> Response:
    if state.status == "serving":
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": state.status, "detail": state.detail}, status_code=503)


def _model_card(state: ServerState) -> JSONObject:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "minisgl",
        "max_model_len": state.max_seq_len,
    }


@router.get("/v1/models")
async def models(state: State) -> dict:
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, state: State) -> JSONObject:
    if not state.knows_model(model_id):
        raise APIError(
            404, f"the model '{model_id}' does not exist", "not_found_error", "model", "model_not_found"
        )
    return {**_model_card(state), "id": model_id}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    body = state.manager.metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def _events(body: SamplingRequest, rid: str, obj: str, name: str) -> _ChunkEvents:
    return _ChunkEvents(rid, obj, name, body.include_usage, body.continuous_usage)


async def _open_chat(
    state: ServerState, request: Request, body: ChatCompletionRequest
) -> list[RequestStream]:
    """The streams of a chat request (its `n` choices): the conversation and the tools in effect
    rendered by the chat template, sampled with the request's parameters."""
    mode = body.tool_mode
    messages, tools_json = state.tools.prompt(body.conversation(), body.tool_dicts if mode != "none" else [])
    options = PromptOptions(body.add_generation_prompt, body.continue_final_message, tools=tools_json)
    params = body.sampling_params()
    return await _open_all(state, request, [messages], params, body.stop_list, body.n, options)


def _tool_outputs(state: ServerState, body: ChatCompletionRequest, n: int) -> list[ToolOutput] | None:
    """What tells each choice's text from its tool calls; None when no tools are in effect."""
    return (
        None
        if body.tool_mode == "none"
        else [ToolOutput(body.tool_mode, state.tools.parser) for _ in range(n)]
    )


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request, state: State) -> Response:
    _check_ready(state, body.model)
    streams = await _open_chat(state, request, body)
    rid, name = f"chatcmpl-{uuid.uuid4().hex}", body.model or state.model_name
    logprobs = [ChatLogprobs() for _ in streams] if body.token_logprobs is not None else None
    tools = _tool_outputs(state, body, len(streams))
    legacy = body.legacy_functions
    if body.stream:
        events = _events(body, rid, "chat.completion.chunk", name)
        roles = [_chat_role(i) for i in range(len(streams))]
        content = events.body(streams, body.n, _chat_delta(logprobs, tools, legacy), head=roles)
        return _StreamResponse(content, lambda: _release_all(state.manager, streams))
    done = await _finish_all(request, state.manager, streams)
    choices: list[JSONObject] = []
    for i, c in enumerate(done):
        message, finish = _chat_message(c, tools[i] if tools else None, legacy)
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": logprobs[i].of([e for ch in c.chunks for e in ch.logprobs]) if logprobs else None,
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
            }
        )
    return _completion_response(rid, "chat.completion", name, choices, _usage(streams, body.n))


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, state: State) -> Response:
    """OpenAI's Responses API, on the chat path (see responses_request.py, responses_output.py)."""
    _check_ready(state, body.model)
    chat = body.chat
    [stream] = await _open_chat(state, request, chat)
    name = body.model or state.model_name
    tools = _tool_outputs(state, chat, 1)
    builder = ResponseBuilder(name, body.echo(), tools[0] if tools else None, body.logprobs)
    if body.stream:
        return _StreamResponse(_response_events(builder, stream), lambda: state.manager.release(stream))
    [done] = await _finish_all(request, state.manager, [stream])
    for chunk in done.chunks:
        builder.feed(chunk)
    builder.complete(_response_usage(stream))
    return JSONResponse(builder.response())


def _response_usage(stream: RequestStream) -> JSONObject:
    return response_usage(stream.prompt_tokens, stream.completion_tokens, stream.cached_tokens)


async def _response_events(builder: ResponseBuilder, stream: RequestStream) -> AsyncIterator[bytes]:
    for event in builder.start():
        yield _named_sse(event)
    try:
        async for chunk in stream.chunks():
            for event in builder.feed(chunk):
                yield _named_sse(event)
    except RequestError as e:
        yield _named_sse(builder.error(e.message, e.status))
        return
    for event in builder.complete(_response_usage(stream)):
        yield _named_sse(event)


def _named_sse(event: JSONObject) -> bytes:
    """An event of the Responses API: its type also on an `event:` line, and no [DONE] after."""
    return f"event: {event['type']}\n".encode() + _sse(event)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    _check_ready(state, body.model)
    prompts: list[TokenizerPrompt] = list(body.prompts())
    params = body.sampling_params()
    options = PromptOptions(echo=body.echo)
    streams = await _open_all(state, request, prompts, params, body.stop_list, body.n, options)
    rid, name = f"cmpl-{uuid.uuid4().hex}", body.model or state.model_name
    logprobs = [CompletionLogprobs() for _ in streams] if params.logprobs is not None else None
    if body.stream:
        events = _events(body, rid, "text_completion", name)
        content = events.body(streams, body.n, _text_choice(logprobs))
        return _StreamResponse(content, lambda: _release_all(state.manager, streams))
    done = await _finish_all(request, state.manager, streams)
    choices: list[JSONObject] = [
        {
            "index": i,
            "text": c.text,
            "logprobs": logprobs[i].of_all(c.chunks) if logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for i, c in enumerate(done)
    ]
    return _completion_response(rid, "text_completion", name, choices, _usage(streams, body.n))


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request, state: State) -> Response:
    """The chapters' native endpoint. Streams `data: {"text": ..., "finish_reason": ...}` events
    then `data: [DONE]`; with "stream": false answers one JSON object."""
    _check_ready(state, None)
    streams = await _open_all(state, request, [body.prompt], body.sampling_params(), body.stop_list, 1)
    [stream] = streams
    if body.stream:
        return _StreamResponse(_generate_events(stream), lambda: state.manager.release(stream))
    [done] = await _finish_all(request, state.manager, streams)
    return JSONResponse(
        {
            "text": done.text,
            "finish_reason": done.finish_reason,
            "prompt_tokens": stream.prompt_tokens,
            "completion_tokens": stream.completion_tokens,
            "cached_tokens": stream.cached_tokens,
        }
    )


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(
        title="minisgl",
        version="0.1.0",
        docs_url=None,
        redoc_url=None,
        exception_handlers=_EXCEPTION_HANDLERS,
    )
    app.state.server = state
    if state.max_request_bytes is not None:
        app.add_middleware(_BodyLimit, limit=state.max_request_bytes)
    app.include_router(router)
    return app

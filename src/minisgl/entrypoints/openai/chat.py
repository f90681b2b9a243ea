"""`POST /v1/chat/completions`: the conversation through the chat template (tools in effect), the
answer as a message or streamed deltas, tool calls parsed out of the text."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from minisgl.entrypoints.openai.logprobs_format import ChatLogprobs
from minisgl.entrypoints.openai.protocol import ChatCompletionRequest
from minisgl.entrypoints.openai.serving import (
    Choice,
    JSONObject,
    completion_response,
    finish_all,
    open_all,
    release_all,
    request_usage,
)
from minisgl.entrypoints.openai.state import ServerState, State, check_ready
from minisgl.entrypoints.openai.streaming import StreamResponse, chunk_events
from minisgl.entrypoints.openai.tools import ToolOutput
from minisgl.frontend.chunk import Chunk
from minisgl.frontend.manager import PromptOptions
from minisgl.frontend.stream import RequestStream

router = APIRouter()


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


def _chat_message(c: Choice, tools: ToolOutput | None, legacy: bool) -> tuple[JSONObject, str]:
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


async def open_chat(
    state: ServerState, request: Request, body: ChatCompletionRequest, field: str | None = None
) -> list[RequestStream]:
    """The streams of a chat request (its `n` choices): the conversation and the tools in effect
    rendered by the chat template, sampled with the request's parameters."""
    mode = body.tool_mode
    messages, tools_json = state.tools.prompt(body.conversation(), body.tool_dicts if mode != "none" else [])
    options = PromptOptions(body.add_generation_prompt, body.continue_final_message, tools=tools_json)
    params = body.sampling_params()
    return await open_all(
        state,
        request,
        [messages],
        params,
        body.stop_list,
        body.n,
        options,
        field or body.grammar_field,
        body.stream,
    )


def tool_outputs(state: ServerState, body: ChatCompletionRequest, n: int) -> list[ToolOutput] | None:
    """What tells each choice's text from its tool calls; None when no tools are in effect."""
    return (
        None
        if body.tool_mode == "none"
        else [ToolOutput(body.tool_mode, state.tools.parser, body.forced_function or "") for _ in range(n)]
    )


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request, state: State) -> Response:
    check_ready(state, body.model)
    streams = await open_chat(state, request, body)
    rid, name = f"chatcmpl-{uuid.uuid4().hex}", body.model or state.model_name
    logprobs = [ChatLogprobs() for _ in streams] if body.token_logprobs is not None else None
    tools = tool_outputs(state, body, len(streams))
    legacy = body.legacy_functions
    if body.stream:
        events = chunk_events(body, rid, "chat.completion.chunk", name)
        roles = [_chat_role(i) for i in range(len(streams))]
        content = events.body(streams, body.n, _chat_delta(logprobs, tools, legacy), head=roles)
        return StreamResponse(content, lambda: release_all(state.manager, streams))
    done = await finish_all(request, state.manager, streams)
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
    return completion_response(rid, "chat.completion", name, choices, request_usage(streams, body.n))

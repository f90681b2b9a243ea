"""`POST /v1/chat/completions`: the conversation through the chat template (tools in effect), the
answer as a message or streamed deltas, tool calls parsed out of the text."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response

from minisgl.entrypoints.openai.errors import APIError
from minisgl.entrypoints.openai.extensions.reasoning import ReasoningSplit
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


def _chat_role(i: int, echo: str) -> JSONObject:
    """The first chunk of chat choice `i`: the assistant's role, and the echo (if asked for)."""
    return {
        "index": i,
        "delta": {"role": "assistant", "content": echo},
        "logprobs": None,
        "finish_reason": None,
    }


@dataclass
class ChoiceOutput:
    """One choice's text as the answer shows it: a reasoning model's reasoning split off (unless
    separate_reasoning is false), then tool calls parsed from the content (when tools are in effect)."""

    tools: ToolOutput | None
    legacy: bool  # the request used `functions`: the answer has `function_call`
    split: ReasoningSplit | None  # None: the reasoning (if any) stays in the content
    include: bool = True  # include_reasoning: the reasoning is returned
    stream_reasoning: bool = True  # streamed as it comes, else in one piece when it ends
    _held: str = ""  # reasoning not streamed yet (stream_reasoning false)

    def delta(self, chunk: Chunk) -> tuple[JSONObject, str | None]:
        """A streamed chunk's delta and finish reason."""
        finish = chunk.finish_reason
        r, c = self._split(chunk.text, chunk.reasoning, finish is not None)
        d: JSONObject = {}
        r = self._stream_reasoning(r, finish is not None)
        if r and self.include:
            d["reasoning_content"] = d["reasoning"] = r
        if self.tools is None:
            return d | {"content": c}, finish  # "" rather than no content: clients concatenate
        parts = self.tools.feed(c)
        if finish is not None:
            more, finish = self.tools.finish(finish)
            parts += more
        d |= _merged_delta(parts, self.legacy)
        if "tool_calls" not in d and "function_call" not in d:
            d.setdefault("content", "")
        return d, _legacy_reason(finish, self.legacy)

    def message(self, c: Choice) -> tuple[JSONObject, str]:
        """A non-streamed choice's message and finish reason."""
        mode = next((ch.reasoning for ch in c.chunks if ch.reasoning), "")
        _, content = self._split(c.text, mode, True)
        finish = c.finish_reason
        message: JSONObject = {"role": "assistant", "content": content}
        if self.tools is not None:
            self.tools.feed(content)
            _, finish = self.tools.finish(c.finish_reason)
            message["content"] = self.tools.content or None
            if self.tools.calls and self.legacy:
                message["function_call"] = self.tools.calls[0].message()["function"]
            elif self.tools.calls:
                message["tool_calls"] = [call.message() for call in self.tools.calls]
        if self.split is not None and mode and self.include:
            message["reasoning_content"] = message["reasoning"] = self.split.reasoning or None
        return message, _legacy_reason(finish, self.legacy) or finish

    def _split(self, text: str, mode: str, final: bool) -> tuple[str, str]:
        if self.split is None:
            return "", text
        r, c = self.split.feed(text, mode)
        if final:
            r2, c2 = self.split.finish()
            r, c = r + r2, c + c2
        return r, c

    def _stream_reasoning(self, r: str, final: bool) -> str:
        if self.stream_reasoning:
            return r
        self._held += r
        if final or (self.split is not None and self.split.content):
            r, self._held = self._held, ""
            return r
        return ""


def choice_outputs(state: ServerState, body: ChatCompletionRequest, n: int) -> list[ChoiceOutput]:
    """What turns each choice's text into the answer's message (see ChoiceOutput)."""
    tools = tool_outputs(state, body, n)
    return [
        ChoiceOutput(
            tools[i] if tools else None,
            body.legacy_functions,
            ReasoningSplit() if body.separate_reasoning else None,
            body.include_reasoning,
            body.stream_reasoning,
        )
        for i in range(n)
    ]


def _chat_delta(
    logprobs: list[ChatLogprobs] | None, outputs: list[ChoiceOutput], token_ids: bool
) -> Callable[[int, Chunk], JSONObject]:
    def delta(i: int, chunk: Chunk) -> JSONObject:
        d, finish = outputs[i].delta(chunk)
        lp = logprobs[i].of(chunk.logprobs) if logprobs else None
        out = {"index": i, "delta": d, "logprobs": lp, "finish_reason": finish}
        if token_ids:
            out["token_ids"] = chunk.token_ids
        if chunk.finish_reason is not None:
            out["stop_reason"] = out["matched_stop"] = chunk.stop_reason
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


async def open_chat(
    state: ServerState, request: Request, body: ChatCompletionRequest, field: str | None = None
) -> list[RequestStream]:
    """The streams of a chat request (its `n` choices): the conversation and the tools in effect
    rendered by the chat template, sampled with the request's parameters."""
    mode = body.tool_mode
    if body.chat_template is not None and not state.trust_request_chat_template:
        raise APIError(
            400,
            "chat_template is not supported: this server runs only its model's chat template (start it "
            "with --trust-request-chat-template to allow a request's own)",
            "invalid_request_error",
            "chat_template",
        )
    messages, tools_json = state.tools.prompt(body.conversation(), body.tool_dicts if mode != "none" else [])
    options = PromptOptions(
        body.generation_prompt,
        body.continue_final_message,
        tools=tools_json,
        include_stop_str=body.include_stop_str,
        chat_template=body.chat_template or "",
        template_kwargs=body.template_kwargs(),
    )
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
    rid, name = f"chatcmpl-{body.id_suffix}", body.model or state.model_name
    logprobs = [ChatLogprobs() for _ in streams] if body.token_logprobs is not None else None
    outputs = choice_outputs(state, body, len(streams))
    echo = body.echo_text
    ids = bool(body.return_token_ids)  # vLLM's token_ids of the choices
    prompt_ids = {"prompt_token_ids": streams[0].prompt_token_ids} if body.returns_prompt_ids else None
    if body.stream:
        events = chunk_events(body, rid, "chat.completion.chunk", name)
        roles = [_chat_role(i, echo) for i in range(len(streams))]
        content = events.body(streams, body.n, _chat_delta(logprobs, outputs, ids), roles, prompt_ids)
        return StreamResponse(content, lambda: release_all(state.manager, streams))
    done = await finish_all(request, state.manager, streams)
    choices: list[JSONObject] = []
    for i, c in enumerate(done):
        message, finish = outputs[i].message(c)
        if echo:
            message["content"] = echo + (message["content"] or "")
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": logprobs[i].of([e for ch in c.chunks for e in ch.logprobs]) if logprobs else None,
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
                "matched_stop": c.stop_reason,  # SGLang's name
            }
        )
        # vLLM's fields, null unless asked for (its clients read them as attributes)
        choices[-1]["token_ids"] = [t for ch in c.chunks for t in ch.token_ids] if ids else None
    usage = request_usage(streams, body.n)
    more = {"prompt_logprobs": None, "prompt_token_ids": None, **(prompt_ids or {})}
    return completion_response(rid, "chat.completion", name, choices, usage, more)

"""`POST /v1/completions`: text completions of one or more prompts (text or token ids), with echo and
logprobs."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from minisgl.entrypoints.openai.logprobs_format import CompletionLogprobs
from minisgl.entrypoints.openai.protocol import CompletionRequest
from minisgl.entrypoints.openai.serving import (
    JSONObject,
    completion_response,
    finish_all,
    open_all,
    release_all,
    request_usage,
)
from minisgl.entrypoints.openai.state import State, check_ready
from minisgl.entrypoints.openai.streaming import StreamResponse, chunk_events
from minisgl.frontend.chunk import Chunk
from minisgl.frontend.manager import PromptOptions, TokenizerPrompt
from minisgl.frontend.stream import RequestStream

router = APIRouter()


def _text_choice(
    logprobs: list[CompletionLogprobs] | None, token_ids: list[RequestStream] | None
) -> Callable[[int, Chunk], JSONObject]:
    """A streamed chunk's choice; with `token_ids` (the streams, for return_token_ids) its tokens'
    ids, and in its first chunk the prompt's."""
    first = set(range(len(token_ids or [])))

    def choice(i: int, chunk: Chunk) -> JSONObject:
        lp = logprobs[i].of(chunk) if logprobs else None
        out = {"index": i, "text": chunk.text, "logprobs": lp, "finish_reason": chunk.finish_reason}
        if chunk.finish_reason is not None:
            out["stop_reason"] = out["matched_stop"] = chunk.stop_reason
        if token_ids is not None:
            out["token_ids"] = chunk.token_ids
            if i in first:
                first.discard(i)
                out["prompt_token_ids"] = token_ids[i].prompt_token_ids
        return out

    return choice


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    check_ready(state, body.model)
    prompts: list[TokenizerPrompt] = list(body.prompts())
    params = body.sampling_params()
    options = PromptOptions(echo=body.echo, include_stop_str=body.include_stop_str)
    streams = await open_all(
        state, request, prompts, params, body.stop_list, body.n, options, body.grammar_field, body.stream
    )
    rid, name = f"cmpl-{body.id_suffix}", body.model or state.model_name
    logprobs = [CompletionLogprobs() for _ in streams] if params.logprobs is not None else None
    if body.stream:
        events = chunk_events(body, rid, "text_completion", name)
        content = events.body(
            streams, body.n, _text_choice(logprobs, streams if body.return_token_ids else None)
        )
        return StreamResponse(content, lambda: release_all(state.manager, streams))
    done = await finish_all(request, state.manager, streams)
    choices: list[JSONObject] = [
        {
            "index": i,
            "text": c.text,
            "logprobs": logprobs[i].of_all(c.chunks) if logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "matched_stop": c.stop_reason,  # SGLang's name
            # vLLM's fields, null unless asked for (its clients read them as attributes)
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }
        for i, c in enumerate(done)
    ]
    if body.return_token_ids:  # vLLM's and SGLang's: per choice
        for s, c, out in zip(streams, done, choices, strict=True):
            out["prompt_token_ids"] = s.prompt_token_ids
            out["token_ids"] = [t for ch in c.chunks for t in ch.token_ids]
    return completion_response(rid, "text_completion", name, choices, request_usage(streams, body.n))

"""`POST /v1/embeddings`: the served model's final hidden states of each input (a text, a list of
texts, token ids or a list of token-id lists), pooled as the model's config says (last token or
mean, `minisgl.models.pooling`) and L2-normalised, as floats or base64 (float32, little-endian).

Each input is one request through the tokenizer and the scheduler, prefilled with the others that
arrive together and answered with its pooled state (no token sampled, its KV freed at once);
`dimensions` truncates and renormalises where the model is trained for it (Matryoshka)."""

from __future__ import annotations

import base64

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from minisgl.core import SamplingParams
from minisgl.entrypoints.openai.embeddings.protocol import EmbeddingRequest
from minisgl.entrypoints.openai.errors import APIError
from minisgl.entrypoints.openai.serving import finish_all, open_all
from minisgl.entrypoints.openai.state import State, check_ready
from minisgl.frontend.manager import TokenizerPrompt
from minisgl.models.pooling import embedding_vector

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, state: State) -> JSONResponse:
    check_ready(state, body.model)
    if body.dimensions is not None and (why := state.pooling.check_dimensions(body.dimensions)):
        raise APIError(400, why, "invalid_request_error", "dimensions")
    prompts: list[TokenizerPrompt] = list(body.inputs())
    params = SamplingParams(max_tokens=1, embed=True)
    streams = await open_all(state, request, prompts, params, [], 1)
    await finish_all(request, state.manager, streams)
    data = []
    for i, s in enumerate(streams):
        if not s.embedding:  # aborted (the server is stopping, --request-timeout)
            raise APIError(503, f"input {i} got no embedding: {s.finish_reason}", "service_unavailable_error")
        vector = embedding_vector(s.embedding, body.dimensions)
        value: list[float] | str = (
            base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            if body.encoding_format == "base64"
            else vector.tolist()
        )
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(s.prompt_tokens for s in streams)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": body.model or state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )

"""The HTTP app: `create_app(state)` builds the FastAPI app from the endpoint modules' routers
(chat, completions, responses, generate, health, embeddings), the error handlers and the body limit; the
launcher runs it under uvicorn, the unit tests against fake workers.

A request with `n` choices (times the number of prompts) becomes that many scheduler requests, each
prompt tokenized once; every error, a client's or ours, is answered in OpenAI's shape.
"""

from __future__ import annotations

from fastapi import FastAPI

from minisgl.entrypoints.openai import chat, completions, generate, health
from minisgl.entrypoints.openai.body_limit import BodyLimit
from minisgl.entrypoints.openai.embeddings import route as embeddings
from minisgl.entrypoints.openai.errors import EXCEPTION_HANDLERS
from minisgl.entrypoints.openai.responses import route as responses
from minisgl.entrypoints.openai.state import ServerState


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(
        title="minisgl",
        version="0.1.0",
        docs_url=None,
        redoc_url=None,
        exception_handlers=EXCEPTION_HANDLERS,
    )
    app.state.server = state
    if state.max_request_bytes is not None:
        app.add_middleware(BodyLimit, limit=state.max_request_bytes)
    for module in (chat, completions, responses, generate, health, embeddings):
        app.include_router(module.router)
    return app

"""What the routes share: the `ServerState` on `app.state.server` (health, model names, the
`FrontendManager` that talks to the workers), reached through the `State` dependency so that a test
can call a route with a state of its own."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from minisgl.entrypoints.openai.errors import APIError
from minisgl.entrypoints.openai.responses.store import ResponseStore
from minisgl.entrypoints.openai.tools import ToolFormat
from minisgl.frontend.manager import FrontendManager
from minisgl.models.pooling import PoolingConfig

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


DEFAULT_TOKENIZE_TIMEOUT_S = 60.0


@dataclass
class ServerState:
    """What the routes need besides the request; `status` drives /health."""

    manager: FrontendManager
    model_name: str
    model_aliases: set[str] = field(default_factory=set)
    max_seq_len: int = 0
    root: str = ""  # what the model was loaded from (a directory, a file)
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413; None: no cap
    tokenize_timeout: float = DEFAULT_TOKENIZE_TIMEOUT_S  # seconds to wait for the tokenizer's verdict
    tools: ToolFormat = field(default_factory=ToolFormat)  # how tools are rendered and parsed
    pooling: PoolingConfig = field(default_factory=PoolingConfig)  # the model's embeddings (/v1/embeddings)
    trust_request_chat_template: bool = False  # requests may bring their own chat_template
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's kept responses
    status: str = "starting"  # starting | serving | stopping | unhealthy
    detail: str = ""
    stalled: str = ""  # while serving: the scheduler ranks that stopped making progress (watchdog.py)
    created: int = field(default_factory=lambda: int(time.time()))

    def knows_model(self, name: str | None) -> bool:
        return name is None or name == self.model_name or name in self.model_aliases


async def server_state(request: Request) -> ServerState:
    """The app's `ServerState`, as a FastAPI dependency (async: FastAPI would run a plain function
    in its thread pool)."""
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]


def check_ready(state: ServerState, model: str | None) -> None:
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

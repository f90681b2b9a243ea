"""Stand-in for vLLM's `tests/utils.py` (copied there in the run's work folder): `RemoteOpenAIServer`
with vLLM's interface (a context manager; `url_root`, `url_for`, `get_client`, `get_async_client`)
that runs `minisgl serve` with the embedded model under the model name the test gives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import openai
from minisgl_peer_server import MinisglServer

# vLLM's ROCm-only server arguments and environment: none here.
ROCM_EXTRA_ARGS: list[str] = []
ROCM_ENV_OVERRIDES: dict[str, str] = {}


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"  # vLLM's servers need one, ours ignores it

    def __init__(
        self,
        model: str,
        vllm_serve_args: Sequence[str] = (),
        *,
        env_dict: dict[str, str] | None = None,
        seed: int | None = 0,
        auto_port: bool = True,
        max_wait_seconds: float | None = None,
        **_: Any,
    ) -> None:
        self.server = MinisglServer(model, vllm_serve_args)
        self.host, self.port = "127.0.0.1", self.server.port

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    @property
    def url_root(self) -> str:
        return self.server.url

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )

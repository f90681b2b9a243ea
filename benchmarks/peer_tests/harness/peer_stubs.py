"""The names the peers' test files import from their own packages (`vllm.*`, `sglang.*`), installed
into sys.modules before the test files are imported.

Harness names are real stand-ins: starting and stopping a server (`popen_launch_server`,
`kill_process_tree`), the served model's tokenizer (`get_tokenizer`, any name) and vocabulary size
(`ModelConfig(...).get_vocab_size()`), the test constants (URL, model names, timeouts). Every other
name is an engine internal that only out-of-scope unit tests use: a placeholder that raises."""

from __future__ import annotations

import sys
import types
import unittest
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse

from minisgl_peer_server import MinisglServer, free_port, tokenizer, vocab_size


class PeerInternal:
    """A peer engine's internal class or function: not part of the HTTP API, so not stood in for."""

    name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{self.name} is a peer engine internal (its tests are out of scope)")


def _internal(name: str) -> type[PeerInternal]:
    return type(name, (PeerInternal,), {"name": name})


def _module(name: str, **attrs: Any) -> types.ModuleType:
    """`name` (and each missing parent) as a package in sys.modules, with `attrs`."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in sys.modules:
            mod = types.ModuleType(sub)
            mod.__path__ = []  # a package, so that submodules import
            sys.modules[sub] = mod
            if i > 1:
                setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], mod)
    mod = sys.modules[name]
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def get_tokenizer(*args: Any, **kwargs: Any) -> Any:
    return tokenizer()


class ModelConfig:
    """vLLM's ModelConfig as the tests use it: the served model's vocabulary size."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_vocab_size(self) -> int:
        return vocab_size()


def install_vllm() -> None:
    _module("vllm", __version__="minisgl-stand-in")
    _module("vllm.version", __version__="minisgl-stand-in")
    _module("vllm.tokenizers", get_tokenizer=get_tokenizer)
    _module("vllm.transformers_utils.tokenizer", get_tokenizer=get_tokenizer)
    _module("vllm.config", ModelConfig=ModelConfig)
    _module("vllm.exceptions", VLLMValidationError=type("VLLMValidationError", (ValueError,), {}))
    _module("vllm.v1.engine.exceptions", EngineDeadError=type("EngineDeadError", (RuntimeError,), {}))
    _module("vllm.sampling_params", SamplingParams=_internal("SamplingParams"))
    for endpoint, cls in (("chat_completion", "ChatCompletionRequest"), ("completion", "CompletionRequest")):
        _module(f"vllm.entrypoints.openai.{endpoint}.protocol", **{cls: _internal(cls)})
    _module("vllm.renderers.embed_utils", safe_load_prompt_embeds=_internal("safe_load_prompt_embeds"))
    _module("vllm.entrypoints.serve.instrumentator.health", health=_internal("health"))
    _module("vllm.envs")


# -- SGLang: sglang.test.test_utils and what the tests import beside it ---------------------------

_SERVERS: dict[int, MinisglServer] = {}


def popen_launch_server(
    model: str,
    base_url: str,
    timeout: float = 600.0,
    api_key: str | None = None,
    other_args: Sequence[str] = (),
    **_: Any,
) -> Any:
    """SGLang's launcher: a server on `base_url`'s port; returns the process (its `.pid` is what
    `kill_process_tree` gets). `api_key` is not checked by minisgl (clients may send any)."""
    server = MinisglServer(model, other_args, port=urlparse(base_url).port)
    _SERVERS[server.pid] = server
    return server.proc


def kill_process_tree(parent_pid: int, include_parent: bool = True, skip_pid: int | None = None) -> None:
    server = _SERVERS.pop(parent_pid, None)
    if server is not None:
        server.stop()


def _placeholder_function(name: str) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name} is a peer engine internal (its tests are out of scope)")

    return fail


def install_sglang() -> None:
    _module(
        "sglang.test.test_utils",
        DEFAULT_URL_FOR_TEST=f"http://127.0.0.1:{free_port()}",
        DEFAULT_MODEL_NAME_FOR_TEST="meta-llama/Llama-3.1-8B-Instruct",
        DEFAULT_SMALL_MODEL_NAME_FOR_TEST="meta-llama/Llama-3.2-1B-Instruct",
        DEFAULT_SMALL_CROSS_ENCODER_MODEL_NAME_FOR_TEST="cross-encoder/ms-marco-MiniLM-L6-v2",
        DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH=600,
        CustomTestCase=unittest.TestCase,  # SGLang's retries failed tests in CI; here each runs once
        popen_launch_server=popen_launch_server,
    )
    _module("sglang.test.runners", TEST_RERANK_QUERY_DOCS=[])
    _module("sglang.srt.utils", kill_process_tree=kill_process_tree, is_npu=lambda: False)
    _module("sglang.srt.utils.hf_transformers_utils", get_tokenizer=get_tokenizer)
    _module("sglang.srt.hf_transformers_utils", get_tokenizer=get_tokenizer)
    _module(
        "sglang.srt.sampling.sampling_params",
        MAX_LEN=2**31,
        get_max_seq_length=_placeholder_function("get_max_seq_length"),
    )

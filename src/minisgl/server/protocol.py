"""The HTTP request bodies (OpenAI-compatible, plus the chapters' native `/generate`).

Pydantic checks types and ranges, so every malformed request becomes a 400 before anything is sent
to a worker. Checks that need the tokenizer (prompt length against the context, token ids against
the vocabulary) happen in the tokenizer worker, which answers with an error reply (also a 400).

Integers are strict (`true`, `"5"` and `5.0` are not integers: `"prompt": [true, false]` is not a
list of token ids). Text must be valid Unicode: JSON may spell a lone surrogate (`"\\ud800"`), which
no UTF-8 pipe can carry, so a body holding one anywhere is refused before any field is read. OpenAI
fields that would change the output but are not implemented are refused by name, not ignored
(tests/test_openai_fields.py walks every field of the openai package's request types).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator, model_validator

from minisgl.core import MAX_LOGPROBS, SamplingParams
from minisgl.tokenizer.tokenize import FILL_CONTEXT, MAX_CHOICES

_INT32 = 2**31 - 1  # bounds keep every number encodable (msgpack) and meaningful downstream
_SEED = 2**63 - 1 - MAX_CHOICES  # seed + choice index stays an int64
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_at(data: object) -> str | None:
    """Where in a decoded JSON value (keys included) a string holds a lone surrogate, e.g.
    "messages[0].content"; None if nowhere. Iterative (JSON nesting depth is the client's choice)
    and quick over long lists of numbers (token ids)."""
    stack: list[tuple[object, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                return _json_path(path)
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and _has_surrogate(k):
                    return f"a key in {_json_path(path)}"
                if isinstance(v, (str, dict, list)):
                    stack.append((v, (*path, str(k))))
        elif isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(value) if isinstance(v, (str, dict, list)))
    return None


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def _json_path(path: tuple[str | int, ...]) -> str:
    out = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return out or "the body"


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Request(_Body):
    """A whole request body (not a part of one)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: object) -> object:
        where = lone_surrogate_at(data)
        if where is not None:
            raise ValueError(f"{where}: text must be valid Unicode (it holds a lone UTF-16 surrogate)")
        return data


# OpenAI fields that minisgl does not implement: refused by name unless absent or "off". Fields
# that cannot change the output (`user`, `metadata`, `service_tier`, `safety_identifier`,
# `prompt_cache_key`, `prompt_cache_options`, `prompt_cache_retention`, `parallel_tool_calls`:
# no tools are accepted) are accepted and have no effect.
_NOT_IMPLEMENTED_OFF: dict[str, tuple[object, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "moderation": (None,),
    "store": (None, False),
    "suffix": (None, ""),
}
_NO_EFFECT = (
    "user",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "parallel_tool_calls",
)
# The accepted range of a logit_bias value (OpenAI's).
_MAX_BIAS = 100.0


def _refuse_unless_off(value: object, info: ValidationInfo) -> object:
    off = _NOT_IMPLEMENTED_OFF[info.field_name or ""]
    if not any(value == o and type(value) is type(o) for o in off):
        raise ValueError(f"{info.field_name} is not supported by this server")
    return value


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk (vLLM's option)
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks: not needed here, no effect


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    # Any role the chat template renders (it refuses the ones it does not know).
    role: Annotated[str, Field(min_length=1)]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class SamplingRequest(_Request):
    """Fields shared by both OpenAI endpoints."""

    model: str | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=_INT32)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=_INT32)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(le=_INT32)] = -1
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0, le=_INT32)]] | None = None
    seed: Annotated[StrictInt, Field(ge=-_SEED, le=_SEED)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = 1.0
    logit_bias: dict[str, Annotated[float, Field(ge=-_MAX_BIAS, le=_MAX_BIAS)]] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0, le=_INT32)] = 0
    # These take any JSON value, and refuse it below unless absent or "off".
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    moderation: Any = None
    store: Any = None

    _off = field_validator(*[f for f in _NOT_IMPLEMENTED_OFF if f != "suffix"], check_fields=False)(
        _refuse_unless_off
    )

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.isascii() or not key.isdigit() or int(key) > _INT32:
                raise ValueError(
                    f"keys must be token ids, got {key[:40]!r} (the tokenizer checks the vocabulary)"
                )
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def stop_list(self) -> list[str]:
        return _stop_list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self) -> SamplingParams:
        """The scheduler's sampling parameters of choice 0 (the tokenizer gives choice i seed + i)."""
        max_tokens = self.max_completion_tokens or self.max_tokens or FILL_CONTEXT
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens,
            logprobs=self.token_logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )

    @property
    def token_logprobs(self) -> int | None:
        """Top alternatives per generated token (None: no logprobs)."""
        return None

    @property
    def prompt_logprobs(self) -> int | None:
        return None


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    @model_validator(mode="after")
    def _chat_options(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        return self

    @property
    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


TokenId = Annotated[StrictInt, Field(ge=-_INT32, le=_INT32)]  # the tokenizer checks the vocabulary
Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    echo: bool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None
    suffix: Any = None

    _suffix_off = field_validator("suffix")(_refuse_unless_off)

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported unless it equals n")
        return self

    @property
    def token_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: Prompt) -> Prompt:
        if isinstance(v, list) and (len(v) == 0 or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("the prompt is empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class GenerateRequest(_Request):
    """The chapters' native endpoint: a prompt, a token budget, and streamed text."""

    prompt: str | list[TokenId]
    max_tokens: Annotated[StrictInt, Field(ge=1, le=_INT32)] = 128
    ignore_eos: bool = False
    temperature: Annotated[float, Field(ge=0.0)] = 0.0
    top_k: Annotated[StrictInt, Field(le=_INT32)] = -1
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop: str | list[str] | None = None
    stream: bool = True

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            ignore_eos=self.ignore_eos,
            max_tokens=self.max_tokens,
        )

    @property
    def stop_list(self) -> list[str]:
        return _stop_list(self.stop)

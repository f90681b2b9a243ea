"""The HTTP request bodies (OpenAI-compatible, plus the chapters' native `/generate`).

Pydantic checks types and ranges, so every malformed request becomes a 400 before anything is sent
to a worker. Checks that need the tokenizer (prompt length against the context, token ids against
the vocabulary) happen in the tokenizer worker, which answers with an error reply (also a 400).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from minisgl.core import SamplingParams
from minisgl.tokenizer.tokenize import FILL_CONTEXT

MAX_N = 64  # choices per prompt
_INT32 = 2**31 - 1  # bounds keep every number encodable (msgpack) and meaningful downstream
_SEED = 2**63 - 1 - MAX_N  # seed + choice index stays an int64


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class SamplingRequest(_Body):
    """Fields shared by both OpenAI endpoints."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=_INT32)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=_INT32)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(le=_INT32)] = -1
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_INT32)]] | None = None
    seed: Annotated[int, Field(ge=-_SEED, le=_SEED)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingRequest:
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, index: int = 0) -> SamplingParams:
        """The scheduler's sampling parameters for choice `index` (seeds differ between choices)."""
        max_tokens = self.max_completion_tokens or self.max_tokens or FILL_CONTEXT
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            seed=None if self.seed is None else self.seed + index,
        )


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


TokenId = Annotated[int, Field(ge=-_INT32, le=_INT32)]  # the tokenizer checks the vocabulary
Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: Prompt) -> Prompt:
        if isinstance(v, list) and (len(v) == 0 or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("the prompt is empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class GenerateRequest(_Body):
    """The chapters' native endpoint: a prompt, a token budget, and streamed text."""

    prompt: str | list[TokenId]
    max_tokens: Annotated[int, Field(ge=1, le=_INT32)] = 128
    ignore_eos: bool = False
    temperature: Annotated[float, Field(ge=0.0)] = 0.0
    top_k: Annotated[int, Field(le=_INT32)] = -1
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
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

"""The `POST /v1/embeddings` request body (OpenAI's fields; `user` is accepted and has no effect)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, field_validator

from minisgl.entrypoints.openai.protocol import _INT32, TokenId, _Request

MAX_INPUTS = 2048  # inputs of one request at most (OpenAI's limit)


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request (`user` is accepted and has no effect)."""

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1, le=_INT32)] | None = None
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else v
        if not items:
            raise ValueError("input must not be empty")
        if isinstance(items[0], int):  # one list of token ids
            return v
        if len(items) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per request, got {len(items)}")
        for i, item in enumerate(items):
            if len(item) == 0:
                raise ValueError("input is empty" if isinstance(v, str) else f"input[{i}] is empty")
        return v

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or a list of token ids."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if v and all(isinstance(t, int) for t in v):
            return [list(v)]  # type: ignore[arg-type]
        return list(v)  # type: ignore[arg-type]

"""Logprobs in OpenAI's two answer shapes, from the token bytes and values the workers send.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, the echoed prompt's
tokens first (the first with null logprob and null alternatives); a completion's alternatives
include the sampled token (as vLLM's do: `logprobs: 0` still shows it). A token's text is its bytes
decoded as UTF-8 (a token holding part of a character shows U+FFFD; `bytes` is exact); a
`text_offset` is where the token starts in the choice's text, counted in those texts' characters,
so streamed chunks go on from where the previous one ended. A log probability below -9999 (the
float32 -inf of a token with no probability at all) is given as -9999, since JSON has no infinity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minisgl.frontend.chunk import Chunk, TokenLogprob

_FLOOR = -9999.0


def _text(token: bytes) -> str:
    return token.decode("utf-8", errors="replace")


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


def _entry(token: bytes, logprob: float) -> dict[str, object]:
    return {"token": _text(token), "logprob": _value(logprob), "bytes": list(token)}


@dataclass
class ChatLogprobs:
    def of(self, entries: list[TokenLogprob]) -> dict[str, object] | None:
        if not entries:
            return None
        content = []
        for e in entries:
            item = _entry(e.token, e.logprob if e.logprob is not None else _FLOOR)
            item["top_logprobs"] = [_entry(t, lp) for t, lp in e.top]
            content.append(item)
        return {"content": content, "refusal": None}


@dataclass
class CompletionLogprobs:
    offset: int = 0  # where the next token starts in the choice's text

    def of(self, chunk: Chunk) -> dict[str, list[Any]] | None:
        entries = (chunk.prompt_logprobs or []) + chunk.logprobs
        if not entries:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = _text(e.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if e.logprob is None else _value(e.logprob))
            top = (
                None
                if e.logprob is None
                else {_text(e.token): _value(e.logprob)} | {_text(t): _value(lp) for t, lp in e.top}
            )
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def of_all(self, chunks: list[Chunk]) -> dict[str, list[Any]]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in chunks:
            for k, v in (self.of(chunk) or {}).items():
                out[k] += v
        return out

"""Tokenizing: a TokenizeMsg (text, chat messages or token ids) into the scheduler's UserMsg.

This is also where a request is checked against the model, because only here are the prompt's
tokens known: an empty prompt, token ids outside the vocabulary, bad sampling parameters and
prompt + max_tokens beyond the context are rejected with a `RequestRejected` that the worker turns
into an error reply for the API server (HTTP 400); the scheduler never sees such a request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.message import TokenizeMsg, UserMsg

# max_tokens of a request that did not say: "as many as the context leaves". Replaced here, once
# the prompt length is known; the scheduler never sees it.
FILL_CONTEXT = -1


class RequestRejected(ValueError):
    """A request that cannot be served as asked; the message is for the client."""


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against; from the scheduler's ready report."""

    max_seq_len: int
    vocab_size: int


class TokenizeManager:
    """Turns TokenizeMsg into UserMsg with one tokenizer, checking each request on the way."""

    def __init__(self, tokenizer: Any, limits: ModelLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def token_ids(self, prompt: str | list[Any]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, list):
            raise RequestRejected(
                f"a prompt must be text, messages or token ids, got {type(prompt).__name__}"
            )
        if prompt and all(isinstance(m, dict) for m in prompt):
            from minisgl.utils.hf import apply_chat_template

            try:
                return apply_chat_template(self.tokenizer, prompt)
            except Exception as e:  # a template may raise anything (e.g. jinja's "roles must alternate")
                raise RequestRejected(f"cannot apply the chat template: {e}") from None
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.limits.vocab_size]
            if bad:
                raise RequestRejected(
                    f"token ids out of the vocabulary (size {self.limits.vocab_size}): {bad[:5]}"
                )
            return list(prompt)
        raise RequestRejected("a prompt list must hold only chat messages or only token ids")

    def prepare(self, msg: TokenizeMsg) -> UserMsg:
        """The scheduler's request for `msg`; raises RequestRejected with a reason for the client."""
        ids = self.token_ids(msg.text)
        if not ids:
            raise RequestRejected("the prompt is empty")
        params = msg.sampling_params
        room = self.limits.max_seq_len - len(ids)
        if params.max_tokens == FILL_CONTEXT:
            if room < 1:
                raise RequestRejected(
                    f"the prompt has {len(ids)} tokens, which fills the context of "
                    f"{self.limits.max_seq_len} tokens"
                )
            params = dataclasses.replace(params, max_tokens=room)
        elif params.max_tokens > room:
            raise RequestRejected(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.limits.max_seq_len} tokens"
            )
        try:
            params.validate(self.limits.vocab_size)
        except ValueError as e:
            raise RequestRejected(str(e)) from None
        return UserMsg(uid=msg.uid, input_ids=torch.tensor(ids, dtype=torch.int32), sampling_params=params)

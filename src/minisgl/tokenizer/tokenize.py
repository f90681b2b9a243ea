"""Tokenizing: a TokenizeMsg (text, chat messages or token ids) into the scheduler's UserMsg.

This is also where a request is checked against the model, because only here are the prompt's
tokens known: `minisgl.core.check_request` (the scheduler's and the offline LLM's check too) rejects
an empty prompt, token ids outside the vocabulary, bad sampling parameters and prompt + max_tokens
beyond the context with a `RequestRejected` that the worker turns into an error reply for the API
server (HTTP 400); the scheduler never sees such a request. One
TokenizeMsg carries all `n` choices of a prompt: it is tokenized once and fanned out.
"""

from __future__ import annotations

import array
import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from minisgl.core import RequestRejected, SamplingParams, check_request, context_error
from minisgl.message import TokenizeMsg, UserMsg
from minisgl.utils.hf import decode_text

from .length_bound import LengthBound
from .reasoning import ReasoningFormat

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

MAX_CHOICES = 64  # n of one request at most (the API's limit, checked again here for the socket)

# max_tokens of a request that did not say: "as many as the context leaves". Replaced here, once
# the prompt length is known; the scheduler never sees it.
FILL_CONTEXT = -1


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against; from the scheduler's ready report."""

    max_seq_len: int
    vocab_size: int


@dataclass(frozen=True)
class ChatOptions:
    """How a chat prompt ends (vLLM's chat request fields of the same names), and what else the
    template gets."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: str = ""  # JSON list of tools for the template ("" for none)
    template: str = ""  # the request's own template ("": the model's)
    variables: str = ""  # JSON object of more template variables ("" for none)

    @classmethod
    def of(cls, msg: TokenizeMsg) -> ChatOptions:
        return cls(
            msg.add_generation_prompt,
            msg.continue_final_message,
            msg.tools,
            msg.chat_template,
            msg.template_kwargs,
        )


class TokenizeManager:
    """Turns TokenizeMsg into UserMsgs with one tokenizer, checking each request on the way.

    A prompt is tokenized once whatever its number of choices, and a text that is longer than the
    context by its length alone (see length_bound.py) is refused without being tokenized."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        limits: ModelLimits,
        reasoning: ReasoningFormat | None = None,
        bound: LengthBound | None | Literal["derive"] = "derive",
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.bound = LengthBound.of(tokenizer) if bound == "derive" else bound  # (derived: ~0.2 s)
        self.reasoning = reasoning  # a reasoning model's format (--reasoning-parser), None if none

    def token_ids(
        self, prompt: str | list[Any], max_tokens: int = FILL_CONTEXT, chat: ChatOptions | None = None
    ) -> list[int]:
        """The prompt's ids; RequestRejected if it is malformed, or a text obviously too long for
        the context with `max_tokens` more."""
        if isinstance(prompt, str):
            self._check_length(prompt, max_tokens)
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, list):
            raise RequestRejected(
                f"a prompt must be text, messages or token ids, got {type(prompt).__name__}"
            )
        if prompt and all(isinstance(m, dict) for m in prompt):
            return self._chat_ids(prompt, max_tokens, chat or ChatOptions())
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)  # checked against the vocabulary by check_request
        raise RequestRejected("a prompt list must hold only chat messages or only token ids")

    def _chat_ids(self, messages: list[dict[str, Any]], max_tokens: int, chat: ChatOptions) -> list[int]:
        from minisgl.utils.hf import render_chat

        if chat.continue_final_message and messages[-1].get("role") != "assistant":
            raise RequestRejected("continue_final_message needs the last message to be the assistant's")
        try:
            tools = json.loads(chat.tools) if chat.tools else None
            variables = _template_variables(chat.variables)
            template = chat.template or getattr(self.tokenizer, "chat_template", None) or ""
            if "reasoning_effort" in variables and "reasoning_effort" not in template:
                raise RequestRejected(
                    "reasoning_effort is not supported: this model's chat template takes none"
                )
            text = render_chat(
                self.tokenizer,
                [_template_message(m) for m in messages],
                chat.add_generation_prompt,
                chat.continue_final_message,
                tools,
                chat.template or None,
                variables,
            )
        except RequestRejected:
            raise
        except Exception as e:  # a template may raise anything (e.g. jinja's "roles must alternate")
            raise RequestRejected(f"cannot apply the chat template: {e}") from None
        self._check_length(text, max_tokens)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _check_length(self, text: str, max_tokens: int) -> None:
        if self.bound is None or len(text) < self.limits.max_seq_len:  # short: cheap to tokenize
            return
        at_least = self.bound.min_tokens(text)
        room = self.limits.max_seq_len - (1 if max_tokens == FILL_CONTEXT else max_tokens)
        if at_least > room:
            completion = 1 if max_tokens == FILL_CONTEXT else max_tokens
            raise RequestRejected(
                context_error(
                    self.limits.max_seq_len,
                    f"at least {at_least + completion}",
                    f"at least {at_least}",
                    completion,
                    prompt_alone=at_least >= self.limits.max_seq_len,
                )
            )

    def prepare(self, msg: TokenizeMsg) -> list[UserMsg]:
        """The scheduler's requests for `msg`, one per choice (uids msg.uid .. msg.uid + n - 1);
        raises RequestRejected with a reason for the client."""
        return self.prepare_chat(msg)[0]

    def prepare_chat(self, msg: TokenizeMsg) -> tuple[list[UserMsg], str]:
        """`prepare`, and where a reasoning model's chat answer starts ("" if not one: see
        reasoning.py), which the acknowledgement tells the API server."""
        if not 1 <= msg.n <= MAX_CHOICES:
            raise RequestRejected(f"n must be in 1..{MAX_CHOICES}, got {msg.n}")
        params = msg.sampling_params
        ids = self.token_ids(msg.text, params.max_tokens, ChatOptions.of(msg))
        mode = ""
        if self.reasoning is not None and _is_chat(msg.text):
            mode = self.reasoning.mode(self.tokenizer, ids)
            start, end = self.reasoning.token_ids(mode)
            params = dataclasses.replace(params, reasoning_start_id=start, reasoning_end_id=end)
        room = self.limits.max_seq_len - len(ids)
        if params.max_tokens == FILL_CONTEXT and ids:
            if room < 1:
                raise RequestRejected(
                    context_error(self.limits.max_seq_len, len(ids) + 1, len(ids), 1, prompt_alone=True)
                )
            params = dataclasses.replace(params, max_tokens=room)
        choices = [_choice(params, i) for i in range(msg.n)]
        for p in choices:
            check_request(ids, p, self.limits.vocab_size, self.limits.max_seq_len)
        input_ids = array.array("i", ids)  # sent as an int32 tensor; no torch or numpy in this process
        msgs = [
            UserMsg(uid=msg.uid + i, input_ids=cast("torch.Tensor", input_ids), sampling_params=p)
            for i, p in enumerate(choices)
        ]
        return msgs, mode

    def echo_text(self, msg: TokenizeMsg, ids: list[int]) -> str:
        """The prompt as `echo` shows it: a text prompt as given, token ids decoded."""
        if not msg.echo:
            return ""
        return msg.text if isinstance(msg.text, str) else decode_text(self.tokenizer, ids)


# apply_chat_template's own parameters: not template variables (documents is one of both).
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _template_variables(text: str) -> dict[str, Any]:
    """The template variables of a TokenizeMsg (a JSON object's text); RequestRejected naming a
    reserved one."""
    if not text:
        return {}
    variables = json.loads(text)
    if not isinstance(variables, dict):
        raise RequestRejected("chat_template_kwargs must be an object")
    reserved = sorted(TEMPLATE_ARGUMENTS & set(variables))
    if reserved:
        raise RequestRejected(f"chat_template_kwargs: {reserved[0]!r} is not a template variable")
    return variables


def _is_chat(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message off the wire as templates take it: "tool_calls" (JSON text there) as a list,
    each call's arguments (JSON text in OpenAI's format) as an object."""
    calls = message.get("tool_calls")
    if not isinstance(calls, str):
        return message
    out = []
    for call in json.loads(calls):
        fn = dict(call.get("function") or {})
        try:
            fn["arguments"] = json.loads(fn.get("arguments", "{}"))
        except (TypeError, ValueError):
            pass  # not JSON: the template gets the text
        out.append({**call, "function": fn})
    return {**message, "tool_calls": out}


def _choice(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of a request: its own seed (seed + index) when the request has one."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)

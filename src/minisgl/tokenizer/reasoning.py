"""Reasoning models (`--reasoning-parser`): which model thinks between `<think>` and `</think>`, and
where each chat answer starts.

Formats: "qwen3" (the answer may open with `<think>`; Qwen3's `enable_thinking: false` closes an
empty reasoning in the prompt) and "deepseek_r1" (the answer starts inside the reasoning, whose
`<think>` the template or the model writes). "auto" picks from the chat template and the
tokenizer: both markers must be single tokens and the template must use them; a template with
`enable_thinking` is Qwen3's. The tokenizer worker tells, per chat prompt, where the answer starts
(`ReasoningFormat.mode`): "inside" (the prompt opened the reasoning), "optional" (the first output
token decides), or "off" (the prompt closed it: no reasoning). The scheduler holds a grammar back
until the reasoning ended (SamplingParams.reasoning_*), the API server splits the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from minisgl.utils.hf import decode_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"
_CLOSED_TAIL = 4  # tokens after a prompt's last `</think>` that may follow a closed (empty) reasoning


@dataclass(frozen=True)
class ReasoningFormat:
    """A reasoning model's format and its marker tokens."""

    name: str
    start_id: int
    end_id: int

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, flag: str = "auto") -> ReasoningFormat | None:
        """The format `flag` names (auto: the template's; none: None); ValueError if the model has
        no single-token markers for a format named explicitly."""
        if flag == "none":
            return None
        if flag not in ("auto", *REASONING_PARSERS):
            raise ValueError(
                f"--reasoning-parser must be auto, none or one of {REASONING_PARSERS}, got {flag!r}"
            )
        ids = _marker_ids(tokenizer)
        template = getattr(tokenizer, "chat_template", None) or ""
        if flag == "auto":
            if ids is None or THINK_END not in template:
                return None
            flag = "qwen3" if "enable_thinking" in template else "deepseek_r1"
        if ids is None:
            raise ValueError(
                f"--reasoning-parser {flag}: the tokenizer has no {THINK_START} and {THINK_END} tokens"
            )
        return cls(flag, *ids)

    def mode(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]) -> str:
        """Where the answer to `prompt_ids` starts: "inside", "optional" or "off" (see above)."""
        for i in range(len(prompt_ids) - 1, -1, -1):
            if prompt_ids[i] == self.start_id:
                return "inside"
            if prompt_ids[i] == self.end_id:
                tail = prompt_ids[i + 1 :]
                if len(tail) <= _CLOSED_TAIL and not decode_text(tokenizer, tail).strip():
                    return "off"
                break
        return "inside" if self.name == "deepseek_r1" else "optional"

    def token_ids(self, mode: str) -> tuple[int, int]:
        """SamplingParams' (reasoning_start_id, reasoning_end_id) for an answer in `mode`."""
        if mode == "off":
            return -1, -1
        return (self.start_id if mode == "optional" else -1), self.end_id


def _marker_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` if each is one token of the vocabulary."""
    start, end = _token_id(tokenizer, THINK_START), _token_id(tokenizer, THINK_END)
    return None if start is None or end is None else (start, end)


def _token_id(tokenizer: PreTrainedTokenizerBase, text: str) -> int | None:
    backend = getattr(
        tokenizer, "backend_tokenizer", None
    )  # a fast tokenizer (the workers' FastTokenizer too)
    token = backend.token_to_id(text) if backend is not None else tokenizer.get_vocab().get(text)
    return None if token is None else int(token)

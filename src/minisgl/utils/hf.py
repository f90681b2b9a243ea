"""Tokenizer helpers. transformers is imported inside the functions: `minisgl.utils` stays cheap to import."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The model directory's fast (Rust) tokenizer; nothing is downloaded."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), use_fast=True, local_files_only=True)
    except Exception as e:  # transformers raises many error types for a bad directory
        error = e
    if (Path(model_dir) / "tokenizer.json").is_file():
        # e.g. a tokenizer_class this transformers version does not know: tokenizer.json is enough
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
        except Exception:
            pass
    raise ValueError(f"{model_dir}: cannot load the tokenizer: {error}") from None


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template, ending with the assistant prompt.

    Renders to text then encodes without adding special tokens (what transformers' tokenize=True
    does), which returns a plain list on every transformers version."""
    return list(tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False))


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template: str | None = None,
    variables: dict[str, Any] | None = None,
) -> str:
    """`messages` rendered with the model's chat template (or `template`) as text, ending with the
    assistant prompt (unless `add_generation_prompt` is False), or with the last message left open
    for the model to continue (`continue_final_message`); `tools` (OpenAI's tool specs) for templates
    that take them; `variables` more names the template sees (e.g. enable_thinking)."""
    if not template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template")
    extra: dict[str, Any] = dict(variables or {})
    if continue_final_message:
        extra["continue_final_message"] = True
    if tools:
        extra["tools"] = tools
    if template:
        extra["chat_template"] = template
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )
    return _text(text, "apply_chat_template(tokenize=False)")


def decode_text(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool = False) -> str:
    """`tokenizer.decode(ids)`: the text of one sequence of ids (typed as such)."""
    return _text(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), "decode")


def _text(value: object, call: str) -> str:
    """transformers types these calls' results as unions; for the arguments given here it is a str."""
    if not isinstance(value, str):
        raise TypeError(f"the tokenizer's {call} returned {type(value).__name__}, not str")
    return value

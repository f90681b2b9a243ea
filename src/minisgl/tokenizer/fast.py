"""The tokenizer workers' tokenizer: a model directory's tokenizer.json (the `tokenizers` library, in
Rust) and its chat template (rendered by transformers' own renderer), without the rest of
transformers' tokenizer classes, whose import pulls in torch: a worker then holds about 60 MiB
instead of 350 and starts seconds sooner.

`FastTokenizer` has the part of transformers' `PreTrainedTokenizerFast` that the workers use
(`encode`, `decode`, `convert_ids_to_tokens`, `all_special_ids`, `backend_tokenizer`,
`chat_template`, `apply_chat_template`), with the same results: the same tokenizer.json, the same
special tokens from tokenizer_config.json, the same template renderer. `load_fast_tokenizer` falls
back to transformers' tokenizer for a directory without a tokenizer.json (a slow tokenizer only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class FastTokenizer:
    def __init__(self, backend: Tokenizer, config: dict[str, Any], chat_template: str | dict | None) -> None:
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.special_tokens_map = {
            name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None
        }
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
        texts = [*self.special_tokens_map.values(), *map(_token_text, extra)]
        ids = [backend.token_to_id(t) for t in texts]
        self.all_special_ids = list(dict.fromkeys(i for i in ids if i is not None))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> FastTokenizer:
        from tokenizers import Tokenizer

        d = Path(model_dir)
        config = _read_json(d / "tokenizer_config.json")
        template: str | dict | None = config.get("chat_template")
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        elif template is None and (d / "chat_template.json").is_file():
            template = _read_json(d / "chat_template.json").get("chat_template")
        return cls(Tokenizer.from_file(str(d / "tokenizer.json")), config, template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """transformers' rendering of one conversation (its renderer, its template variables), with
        the tokenizer's chat template or `chat_template`."""
        from transformers.tokenization_utils_base import _normalize_chat_messages
        from transformers.utils.chat_template_utils import render_jinja_template

        template = chat_template or self.chat_template
        if isinstance(template, dict):  # named templates
            template = template.get("tool_use" if tools is not None and "tool_use" in template else "default")
        if not template:
            raise ValueError("this tokenizer has no chat template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        rendered, _ = render_jinja_template(
            conversations=[_normalize_chat_messages(messages)],
            tools=tools,
            chat_template=template,
            continue_final_message=continue_final_message,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )
        return self.encode(rendered[0], add_special_tokens=False) if tokenize else rendered[0]


def load_fast_tokenizer(model_dir: str | Path) -> FastTokenizer | PreTrainedTokenizerBase:
    """The workers' tokenizer for `model_dir` (see the module's docstring)."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        try:
            return FastTokenizer.from_dir(model_dir)
        except Exception as e:  # a tokenizer.json this tokenizers version cannot read
            raise ValueError(f"{model_dir}: cannot load the tokenizer: {e}") from None
    from minisgl.utils.hf import load_tokenizer

    return load_tokenizer(model_dir)


def _token_text(value: object) -> str:
    """A special token given as a string, or as an AddedToken dict ({"content": ...})."""
    return str(value.get("content")) if isinstance(value, dict) else str(value)


def _clean_up_spaces(text: str) -> str:
    """transformers' `clean_up_tokenization`: no space before punctuation and some contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(a, b)
    for a, b in ((" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}

"""minisgl.utils.hf: loading a model directory's tokenizer and applying its chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_models_support import save_tiny_tokenizer

from minisgl.utils.hf import apply_chat_template, load_tokenizer


def test_chat_template_gives_token_ids(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path, vocab=131)
    tok = load_tokenizer(tmp_path)
    assert tok.is_fast
    ids = apply_chat_template(tok, [{"role": "user", "content": "Hi"}])
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "user: Hi\nassistant: "


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        load_tokenizer(tmp_path / "nothing-here")


def test_unknown_tokenizer_class_falls_back_to_tokenizer_json(tmp_path: Path) -> None:
    """A tokenizer_class this transformers version lacks (e.g. a v5 name on v4): tokenizer.json is used."""
    import json

    save_tiny_tokenizer(tmp_path, vocab=131)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "NoSuchTokenizerClass"
    cfg_path.write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    assert tok.decode(tok.encode("ab", add_special_tokens=False)) == "ab"
    assert tok.eos_token == "</s>"

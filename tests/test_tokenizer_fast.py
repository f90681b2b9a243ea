"""The tokenizer workers' tokenizer (tokenizers + transformers' template renderer, no torch) against
transformers' own tokenizer on the same directory, and the workers' imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from minisgl.models import resolve_model_path
from minisgl.tokenizer.fast import FastTokenizer
from minisgl.utils.hf import load_tokenizer, render_chat
from test_models_support import save_tiny_tokenizer

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "日本語 🙂 ünïcode",
    "  spaces\n\tand tabs ",
    "<|im_start|>hi",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module", params=["embedded", "tiny"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "embedded":
        return resolve_model_path(None)
    out = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(out, 131)
    return out


def test_same_ids_text_and_chat_as_transformers(model_dir: Path) -> None:
    fast, hf = FastTokenizer.from_dir(model_dir), load_tokenizer(model_dir)
    for text in TEXTS:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == list(
                hf.encode(text, add_special_tokens=special)
            )
        ids = list(hf.encode(text))
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert render_chat(fast, CHAT) == render_chat(hf, CHAT)
    assert render_chat(fast, CHAT, add_generation_prompt=False) == render_chat(
        hf, CHAT, add_generation_prompt=False
    )
    last = {"add_generation_prompt": False, "continue_final_message": True}
    assert render_chat(fast, CHAT[:3], **last) == render_chat(hf, CHAT[:3], **last)
    assert fast.all_special_ids == list(hf.all_special_ids)
    assert [fast.convert_ids_to_tokens(i) for i in range(100)] == [
        hf.convert_ids_to_tokens(i) for i in range(100)
    ]


def test_the_workers_and_the_api_server_import_no_torch() -> None:
    """What the tokenizer worker and the HTTP front end load: no torch (the scheduler's alone)."""
    code = (
        "import sys\n"
        "import minisgl.tokenizer.server, minisgl.entrypoints.openai.app\n"
        "from minisgl.models.resolve import embedded_gguf_path\n"
        "from minisgl.tokenizer.fast import load_fast_tokenizer\n"
        "from minisgl.tokenizer.tokenize import TokenizeManager\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr

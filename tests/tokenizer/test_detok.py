"""Incremental detokenizing: the concatenated deltas equal the full decode, and no delta ever holds a
broken character. Runs against the embedded model's byte-level BPE tokenizer and against a small
Llama-style SentencePiece tokenizer (leading-space marker, byte fallback) built here."""

from __future__ import annotations

import random

import pytest

from minisgl.message import DetokenizeMsg, ErrorMsg
from minisgl.tokenizer.detokenize import DetokenizeManager, IncrementalDetokenizer, fast_decoder

TEXTS = [
    "Hello, world! How are you today?",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "Emoji: 🎉🚀👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 mixed with text 😀!",
    "Mixed 中文 and English, 日本語のテキスト, 한국어 텍스트, Ελληνικά, русский.",
    "  leading spaces,\ttabs\nnew lines\n\n  and   runs   of spaces  ",
    "def f(x):\n    return x ** 2  # square\n",
    'Numbers 1234567890 and symbols ~!@#$%^&*()_+{}|:"<>?',
]


@pytest.fixture(scope="module")
def smol():
    """The embedded model's tokenizer (byte-level BPE)."""
    from minisgl.models import resolve_model_path
    from minisgl.utils.hf import load_tokenizer

    return load_tokenizer(resolve_model_path(None))


def llama_style_tokenizer():
    """A tiny SentencePiece-like BPE: "▁" marks spaces, unknown characters fall back to <0xNN> bytes,
    and the decoder strips the first leading space (Llama 2's tokenizer.json layout)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = list("abcdefghijklmnopqrstuvwxyz,.!?") + ["▁", "▁h", "▁he", "▁hel", "▁hell", "▁hello"]
    pieces += ["▁w", "▁wo", "▁wor", "▁worl", "▁world", "▁t", "▁th", "▁the"]
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o")]
    merges += [("▁", "w"), ("▁w", "o"), ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d")]
    merges += [("▁", "t"), ("▁t", "h"), ("▁th", "e")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def llama_like():
    return llama_style_tokenizer()


def stream(tokenizer, ids: list[int], skip_special_tokens: bool = True, fast: bool = True) -> list[str]:
    """The deltas of `ids`, decoded with the Rust tokenizer (what the worker uses) or the HF wrapper."""
    det = IncrementalDetokenizer(fast_decoder(tokenizer) if fast else tokenizer, skip_special_tokens)
    deltas = [det.step(t) for t in ids]
    deltas.append(det.finish())
    return deltas


def assert_streams_like_full_decode(tokenizer, ids: list[int], fast: bool = True) -> None:
    deltas = stream(tokenizer, ids, fast=fast)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    # Only the final flush may show a replacement character (a sequence cut inside a character).
    for d in deltas[:-1]:
        assert not d.endswith("\ufffd"), (ids, deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_real_texts_round_trip(smol, text: str) -> None:
    ids = smol.encode(text, add_special_tokens=False)
    deltas = stream(smol, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_cjk_and_emoji_never_split(smol) -> None:
    text = "你好🎉世界👨‍👩‍👧"
    ids = smol.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # byte-level BPE splits these characters over several tokens
    deltas = [d for d in stream(smol, ids) if d]
    for d in deltas:
        d.encode("utf-8")  # every delta is whole, valid text
        assert "\ufffd" not in d
    assert "".join(deltas) == text


@pytest.mark.parametrize("fast", [True, False])
def test_random_sequences_match_full_decode(smol, fast: bool) -> None:
    assert fast_decoder(smol) is smol.backend_tokenizer  # the worker's fast path applies to this model
    rng = random.Random(1234)
    vocab = len(smol)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 24))]
        assert_streams_like_full_decode(smol, ids, fast)


def test_random_real_token_mixes(smol) -> None:
    """Token ids of real CJK/emoji text, shuffled: many partial-byte tokens next to each other."""
    rng = random.Random(7)
    pool = [t for text in TEXTS for t in smol.encode(text, add_special_tokens=False)]
    for _ in range(200):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        assert_streams_like_full_decode(smol, ids)


def test_eos_text_is_skipped(smol) -> None:
    eos = smol.eos_token_id
    ids = smol.encode("The answer is 42.", add_special_tokens=False) + [eos]
    text = "".join(stream(smol, ids))
    assert text == "The answer is 42."
    assert smol.eos_token not in text
    # ...and shown when special tokens are not skipped.
    assert "".join(stream(smol, ids, skip_special_tokens=False)).endswith(smol.eos_token)


def test_llama_style_spacing_and_byte_fallback(llama_like) -> None:
    tok = llama_like
    text = "hello world the 你好 🎉 world!"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # byte fallback in use
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert deltas[0] == "hello"  # the first token's marker is stripped, like the full decode
    assert " world" in deltas  # later tokens keep their leading space


def test_llama_style_random_texts(llama_like) -> None:
    """Random texts over letters, spaces, CJK and emoji: whole characters as byte-fallback tokens.

    (Random *ids* are not used here: an invalid run of <0xNN> tokens decodes to one U+FFFD per token,
    grouped differently in a window than in the whole sequence; a model does not produce those.)"""
    rng = random.Random(99)
    chars = list("helowrdt ,.!") + ["你", "好", "世", "界", "🎉", "👍", "é", "ß"]
    for _ in range(300):
        text = "".join(rng.choice(chars) for _ in range(rng.randint(1, 25)))
        ids = llama_like.encode(text, add_special_tokens=False)
        assert_streams_like_full_decode(llama_like, ids)


def test_manager_counts_tokens_and_finishes(smol) -> None:
    mgr = DetokenizeManager(smol)
    ids = smol.encode("你好世界", add_special_tokens=False)
    replies = [DetokenizeMsg(uid=3, next_token=t, finished=False) for t in ids[:-1]]
    replies.append(DetokenizeMsg(uid=3, next_token=ids[-1], finished=True, finish_reason="length"))
    out = [mgr.detokenize(m) for m in replies]
    assert "".join(r.incremental_output for r in out) == "你好世界"
    assert [r.completion_tokens for r in out] == list(range(1, len(ids) + 1))
    assert out[-1].finished and out[-1].finish_reason == "length"
    assert not any(r.finished for r in out[:-1])
    assert len(mgr) == 0  # state dropped at the end


def test_manager_abort_reply_without_token(smol) -> None:
    mgr = DetokenizeManager(smol)
    first = mgr.detokenize(DetokenizeMsg(uid=1, next_token=smol.encode("Hi")[0], finished=False))
    last = mgr.detokenize(DetokenizeMsg(uid=1, next_token=-1, finished=True, finish_reason="abort"))
    assert first.incremental_output == "Hi" and last.incremental_output == ""
    assert last.finish_reason == "abort" and last.completion_tokens == 1


def test_manager_error_reply(smol) -> None:
    mgr = DetokenizeManager(smol)
    reply = mgr.reject(ErrorMsg(uid=5, message="prompt too long"))
    assert reply.finished and reply.finish_reason == "error" and reply.error == "prompt too long"

"""The exact bytes of one token, for logprobs (`bytes` in OpenAI's answer; a token may hold part of
a UTF-8 character, so its text alone cannot say).

Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) spells each byte as one printable character: the
inverse of that alphabet gives the bytes. SentencePiece with byte fallback spells a raw byte as
`<0xNN>` and a space as "▁". Added (special) tokens are their text. Anything else: the decoded text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

from minisgl.utils.hf import decode_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BYTE_FALLBACK_LEN = len("<0x00>")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def _decoder_types(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return set()
    found, stack = set(), [decoder]
    while stack:
        d = stack.pop()
        if isinstance(d, dict):
            found.add(d.get("type", ""))
            stack.extend(d.get("decoders") or [])
    return found


def token_bytes_fn(tokenizer: PreTrainedTokenizerBase) -> Callable[[int], bytes]:
    """id -> the token's bytes (memoized), for `tokenizer` (a Hugging Face tokenizer)."""
    kinds = _decoder_types(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    alphabet = _byte_level_alphabet()

    def piece(token_id: int) -> bytes:
        text = tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(text, str) or token_id in special:
            return decode_text(tokenizer, [token_id]).encode()
        if "ByteLevel" in kinds and all(c in alphabet for c in text):
            return bytes(alphabet[c] for c in text)
        if "ByteFallback" in kinds and len(text) == _BYTE_FALLBACK_LEN and text.startswith("<0x"):
            return bytes([int(text[3:5], 16)])
        if "ByteFallback" in kinds or "Metaspace" in kinds:
            return text.replace("\u2581", " ").encode()
        return decode_text(tokenizer, [token_id]).encode()

    return lru_cache(maxsize=1 << 16)(piece)
